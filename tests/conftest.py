"""Settings and shared fixtures for every test run, `make test` or a plain `python -m pytest`.

One BLAS thread, for this process and for every notebook kernel nbval starts (kernels inherit
the environment): the series runs on busy machines (class laptops, Binder pods), where
OpenBLAS's default of a thread per core made single cells 5-30 times slower. An explicit
setting in the environment wins.

Figures: matplotlib draws with Agg (no window, no display), chosen once when pytest starts,
before any test module imports pyplot. Every test's figures are closed after it; a module or a
test that uses `no_figure_leaks` also fails when it leaves more figures open than it found.

tools/ is importable (`import lessons`, `import measure_windows`), as its scripts import
each other.

Hypothesis runs derandomized (the "deterministic" profile below): the same examples every run.

Models, loaded once a test module (a module may define its own fixture of the same name):
`params`, the article's toy model (kvlib.init_params()); `article_ids`, its prompt "How are
you?" as token ids; `story_model`, the shipped stories model in float64 and its tokenizer;
`smollm2` and `smollm2_tokenizer`, SmolLM2-135M-Instruct (memory-mapped float32 weights).
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_ALREADY_SET = any(variable in os.environ for variable in BLAS_THREAD_VARIABLES)
for _variable in BLAS_THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")

sys.path.append(str(Path(__file__).resolve().parent.parent / "tools"))

# Property tests draw the same examples on every run (a seed derived from each test), so that a
# run, and CI, is reproducible; KVLIB_HYPOTHESIS=explore draws new ones each time, to hunt.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("KVLIB_HYPOTHESIS", "deterministic"))


def pytest_configure(config):
    """Before any test module is imported: Agg for every figure, and one BLAS thread even if
    numpy was loaded before the variables above were set (by a plugin)."""
    import matplotlib

    matplotlib.use("Agg")
    if not _ALREADY_SET:
        from kvlib import roofline

        roofline.set_blas_threads(1)


# ------------------------------------------------------------------------------------ figures

def _pyplot():
    """pyplot, if anything imported it (a test that drew nothing has nothing to close)."""
    return sys.modules.get("matplotlib.pyplot")


@pytest.fixture(autouse=True)
def close_figures():
    """Every test starts its successors with no figure of its own left open."""
    yield
    if (plt := _pyplot()) is not None:
        plt.close("all")


@pytest.fixture
def no_figure_leaks():
    """The test must leave the set of open pyplot figures as it found it (use it in a module
    with `pytestmark = pytest.mark.usefixtures("no_figure_leaks")`)."""
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    yield
    assert set(plt.get_fignums()) == before, "the test left a figure open"


# ------------------------------------------------------------------------------------- models

@pytest.fixture(scope="module")
def params():
    """The article's toy model: 3 layers, d_model 4, 2 heads, a vocabulary of 12 words."""
    import kvlib

    return kvlib.init_params()


@pytest.fixture(scope="module")
def article_ids():
    """The article's prompt, "How are you?", as the toy model's ids: [0, 3, 7, 1, 9]."""
    import kvlib

    return kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)


@pytest.fixture(scope="module")
def story_model():
    """(params in float64, tokenizer) of the stories model that ships with kvlib."""
    from kvlib import stories

    return stories.load_model(dtype="float64"), stories.load_tokenizer()


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's weights, float32 and memory-mapped (`make smollm2` fetches it)."""
    import kvlib

    return kvlib.load_smollm2()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    import kvlib

    return kvlib.smollm2_tokenizer()
