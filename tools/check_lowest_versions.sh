#!/usr/bin/env bash
# The lowest versions requirements.txt allows, tested together: every direct requirement at
# the floor of its range (uv's --resolution lowest-direct), on the oldest Python the README
# supports, then the whole test suite. `make lowest-check`; about five minutes. Needs the
# package registry; writes nothing outside a temporary folder.
#
#     PYTHON=python3.10 bash tools/check_lowest_versions.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3.10}"
command -v "$python" > /dev/null || { echo "no $python on PATH (set PYTHON=...)" >&2; exit 1; }
work="$(mktemp -d "${TMPDIR:-/tmp}/lowest-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install --quiet uv
"$work/tools/bin/uv" venv --quiet --python "$python" "$work/venv"
(cd "$root" && VIRTUAL_ENV="$work/venv" "$work/tools/bin/uv" pip install --quiet \
    --resolution lowest-direct -r requirements.txt)
echo "lowest direct requirements on $("$work/venv/bin/python" --version):"
VIRTUAL_ENV="$work/venv" "$work/tools/bin/uv" pip freeze | grep -iE "^($(sed -n \
    's/^\([A-Za-z0-9_.-]*\)[<>=].*/\1/p' "$root/requirements.txt" | paste -sd'|'))=="
# Every notebook cell runs and every assert must hold, but printed text is not compared
# (--nbval-lax): the committed outputs come from the current versions, and float32 results
# can differ in their last printed digit at the lowest ones (numpy 2.0 against 2.4 in
# notebook 22's quality table: 0.0087 against 0.0088).
cd "$root" && "$work/venv/bin/python" -m pytest -q -x -p no:cacheprovider --nbval-lax
