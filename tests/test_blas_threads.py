"""kvlib runs numpy's BLAS on one thread wherever a kernel starts (an editor, a JupyterHub, a
plain `python`), unless the environment chose a number itself."""

import os
import subprocess
import sys

import pytest

from kvlib import roofline

if roofline.blas_threads() is None:
    pytest.skip("numpy is not linked to OpenBLAS here", allow_module_level=True)

ASK = "import kvlib; from kvlib import roofline; print(roofline.blas_threads())"


def threads_after_import(**environment) -> int:
    env = {name: value for name, value in os.environ.items()
           if name not in roofline.BLAS_THREAD_VARIABLES} | environment
    result = subprocess.run([sys.executable, "-c", ASK], env=env, capture_output=True,
                            text=True, check=True)
    return int(result.stdout)


def test_importing_kvlib_sets_one_thread():
    assert threads_after_import() == 1


def test_a_thread_count_in_the_environment_is_kept():
    assert threads_after_import(OPENBLAS_NUM_THREADS="2") == 2
