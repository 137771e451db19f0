"""Settings for every test run, `make test` or a plain `python -m pytest`.

One BLAS thread, for this process and for every notebook kernel nbval starts (kernels inherit
the environment): the series runs on busy machines (class laptops, Binder pods), where
OpenBLAS's default of a thread per core made single cells 5-30 times slower. An explicit
setting in the environment wins.
"""

import os

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_ALREADY_SET = any(variable in os.environ for variable in BLAS_THREAD_VARIABLES)
for _variable in BLAS_THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")

if not _ALREADY_SET:    # numpy may be loaded already (by a plugin): tell OpenBLAS directly
    from kvlib import roofline

    roofline.set_blas_threads(1)
