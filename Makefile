# Two commands: `make lab` to work through the series, `make test` to check everything.
# Both create the virtual environment .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.installed
FIRST_NOTEBOOK := notebooks/00_big_picture.ipynb

.PHONY: setup lab test lint notebooks clean

$(READY): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed, found " + sys.version)'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(READY)

setup: $(READY)

lab: $(READY)
	$(BIN)/jupyter lab $(FIRST_NOTEBOOK)

test: $(READY)
	$(BIN)/python -m pytest

lint: $(READY)
	$(BIN)/ruff check kvlib tests

# Re-execute every notebook top to bottom and save its outputs and widget state.
notebooks: $(READY)
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace notebooks/[0-9]*.ipynb

clean:
	rm -rf $(VENV)
