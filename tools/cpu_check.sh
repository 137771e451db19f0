#!/usr/bin/env bash
# `make cpu-check`: every notebook (nbval, strict) and every test under several of OpenBLAS's
# kernels on this one machine. numpy's OpenBLAS picks its kernels by processor at run time, and
# kernels add float32 products in different orders: a committed output or an assert that rests
# on float32 rounding (a free-running generation, a near-tie, a printed last digit) passes on
# one processor and fails on another. OPENBLAS_CORETYPE makes this machine use another
# processor's kernels (each runs on any x86-64 with the instructions it needs), so one machine
# shows the spread. "native" is the machine's own choice. About 10-15 minutes a kernel, idle.
#
#     bash tools/cpu_check.sh                    # Haswell, Sandybridge, Prescott, native
#     bash tools/cpu_check.sh Haswell SkylakeX   # some kernels
set -uo pipefail
cd "$(dirname "$0")/.."
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(Haswell Sandybridge Prescott native)
failed=()
for kernel in "${kernels[@]}"; do
    echo "== OpenBLAS kernels: $kernel"
    if [ "$kernel" = native ]; then
        env -u OPENBLAS_CORETYPE .venv/bin/python -m pytest -q -p no:cacheprovider \
            --deselect tests/test_cells_run_twice.py || failed+=("$kernel")
    else
        OPENBLAS_CORETYPE="$kernel" .venv/bin/python -m pytest -q -p no:cacheprovider \
            --deselect tests/test_cells_run_twice.py || failed+=("$kernel")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed under: ${failed[*]}" >&2
    exit 1
fi
echo "every notebook and test passed under: ${kernels[*]}"
