"""Settings for every test run, `make test` or a plain `python -m pytest`.

One BLAS thread, for this process and for every notebook kernel nbval starts (kernels inherit
the environment): the series runs on busy machines (class laptops, Binder pods), where
OpenBLAS's default of a thread per core made single cells 5-30 times slower. An explicit
setting in the environment wins.

Hypothesis runs derandomized (the "deterministic" profile below): the same examples every run.
"""

import os

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_ALREADY_SET = any(variable in os.environ for variable in BLAS_THREAD_VARIABLES)
for _variable in BLAS_THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")

if not _ALREADY_SET:    # numpy may be loaded already (by a plugin): tell OpenBLAS directly
    from kvlib import roofline

    roofline.set_blas_threads(1)

# Property tests draw the same examples on every run (a seed derived from each test), so that a
# run, and CI, is reproducible; KVLIB_HYPOTHESIS=explore draws new ones each time, to hunt.
from hypothesis import settings  # noqa: E402

settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("KVLIB_HYPOTHESIS", "deterministic"))
