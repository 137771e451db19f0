"""Bad and odd input on the names a learner calls: every outcome is a valid result or a
ValueError/TypeError raised by kvlib's own checks (the last frame is in kvlib, not deep in
numpy), and no failing call changes a cache.

The scope is tests/fuzz_scope.py: what the notebooks' code cells and the exercises' solutions
call (tools/learner_names.py finds it; a test below checks that it is current). The first
tests fuzz the core's calls one by one; test_every_public_function_answers_odd_input fuzzes a
valid call of each name of the scope (the table in tests/fuzz_api_cases.py, which also holds
kvlib.serving's cases), one argument at a time. Other functions trust their callers.
"""

import contextlib
import copy
import importlib
import math
import os
import pkgutil
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
from fuzz_api_cases import CASES, SERVING_NOT_FUZZED, same
from fuzz_scope import LEARNER_NAMES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlib
import kvlib.serving
from kvlib import gpt2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import learner_names  # noqa: E402

KVLIB = str(Path(kvlib.__file__).parent)

ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 40), st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.binary(max_size=3),
    st.sampled_from([np.int32(3), np.int64(-2), np.float32(0.5), np.float64(np.nan)]),
    st.lists(st.integers(-3, 20), max_size=4),
    st.sampled_from([[1, [2, 3]], [[1, 2], [3, 4]], {}, (1.5,), object(), [], [[]],
                     np.array(["a", "b"]), np.array([1, None], dtype=object),
                     np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((1, 4), dtype=np.float32),
                     np.array([[1, 2]]), np.array(3)]),
)

PARAMS = kvlib.init_params()
WINDOWED = kvlib.init_params(kvlib.ModelConfig(positions="rotary", window=3, sink_tokens=1))
CONFIG = PARAMS.config
TOY = kvlib.ToyTokenizer()


def fresh_cache(params=PARAMS):
    return kvlib.prefill(params, [0, 3, 7])[1]


def state(cache):
    return (cache.lengths, [(cache.keys(i).copy(), cache.values(i).copy())
                            for i in range(cache.config.n_layers)])


def same_state(a, b):
    return a[0] == b[0] and all(np.array_equal(x, y) and np.array_equal(v, w)
                                for (x, v), (y, w) in zip(a[1], b[1]))


CALLS = {
    "forward ids": lambda v, c: kvlib.forward(PARAMS, v),
    "forward last_only": lambda v, c: kvlib.forward(PARAMS, [0, 1], last_only=v),
    "forward record_attention": lambda v, c: kvlib.forward(PARAMS, [0, 1], record_attention=v),
    "prefill ids": lambda v, c: kvlib.prefill(PARAMS, v, c),
    "prefill cache": lambda v, c: kvlib.prefill(PARAMS, [0, 1], v),
    "prefill last_only": lambda v, c: kvlib.prefill(PARAMS, [1], c, last_only=v),
    "decode_step token": lambda v, c: kvlib.decode_step(PARAMS, v, c),
    "decode_step record": lambda v, c: kvlib.decode_step(PARAMS, 1, c, record_attention=v),
    "decode_step window token": lambda v, c: kvlib.decode_step(
        WINDOWED, v, fresh_cache(WINDOWED)),
    "generate n": lambda v, c: kvlib.generate(PARAMS, [0], v),
    "generate use_cache": lambda v, c: kvlib.generate(PARAMS, [0], 2, use_cache=v),
    "generate temperature": lambda v, c: kvlib.generate(PARAMS, [0], 2, temperature=v),
    "generate top_k": lambda v, c: kvlib.generate(PARAMS, [0], 2, temperature=1.0, top_k=v),
    "generate seed": lambda v, c: kvlib.generate(PARAMS, [0], 2, temperature=1.0, seed=v),
    "next_token_probabilities row": lambda v, c: kvlib.next_token_probabilities(v),
    "next_token_probabilities temperature": lambda v, c: kvlib.next_token_probabilities(
        [1.0, 2.0], v),
    "next_token_probabilities top_k": lambda v, c: kvlib.next_token_probabilities(
        [1.0, 2.0], 1.0, v),
    "choose_next_token row": lambda v, c: kvlib.choose_next_token(v),
    "choose_next_token rng": lambda v, c: kvlib.choose_next_token([1.0, 2.0], 1.0, None, v),
    "init_params config": lambda v, c: kvlib.init_params(v),
    "init_params seed": lambda v, c: kvlib.init_params(None, v),
    "KVCache config": lambda v, c: kvlib.KVCache(v),
    "KVCache capacity": lambda v, c: kvlib.KVCache(CONFIG, v),
    "ConcatenatingKVCache capacity": lambda v, c: kvlib.ConcatenatingKVCache(CONFIG, v),
    "make_cache": lambda v, c: kvlib.make_cache(v),
    "cache.keys": lambda v, c: c.keys(v),
    "cache.values": lambda v, c: c.values(v),
    "cache.append K": lambda v, c: c.append(0, v, np.zeros((1, 4))),
    "cache.append V": lambda v, c: c.append(0, np.zeros((1, 4)), v),
    "cache.append layer": lambda v, c: c.append(v, np.zeros((1, 4)), np.zeros((1, 4))),
    "cache.truncate": lambda v, c: c.truncate(v),
    "cache.key_positions": lambda v, c: c.key_positions(v),
    "kv_cache_bytes n_layers": lambda v, c: kvlib.kv_cache_bytes(v, 8, 10),
    "kv_cache_bytes seq_len": lambda v, c: kvlib.kv_cache_bytes(2, 8, v),
    "kv_cache_bytes n_kv_heads": lambda v, c: kvlib.kv_cache_bytes(2, None, 10, n_kv_heads=v,
                                                                   head_dim=4),
    "latent_cache_bytes": lambda v, c: kvlib.latent_cache_bytes(2, v, 0, 10),
    "config_cache_bytes": lambda v, c: kvlib.config_cache_bytes(CONFIG, v),
    "forward_multiply_adds": lambda v, c: kvlib.forward_multiply_adds(CONFIG, v),
    "decode_step_multiply_adds": lambda v, c: kvlib.decode_step_multiply_adds(CONFIG, v),
    "generation_multiply_adds": lambda v, c: kvlib.generation_multiply_adds(CONFIG, v, 3),
    "generation_multiply_adds config": lambda v, c: kvlib.generation_multiply_adds(v, 2, 3),
    "count_multiply_adds": lambda v, c: kvlib.count_multiply_adds(kvlib.forward, v, [0]),
    "ToyTokenizer.encode": lambda v, c: TOY.encode(v),
    "ToyTokenizer.encode add_bos": lambda v, c: TOY.encode("How", add_bos=v),
    "ToyTokenizer.decode": lambda v, c: TOY.decode(v),
    "ToyTokenizer vocabulary": lambda v, c: kvlib.ToyTokenizer(v),
    "gpt2 Tokenizer.encode": lambda v, c: gpt2.Tokenizer.gpt2().encode(v),
    "gpt2 Tokenizer.decode": lambda v, c: gpt2.Tokenizer.gpt2().decode(v),
    "params.with_config window": lambda v, c: PARAMS.with_config(window=v),
    "add_positions": lambda v, c: kvlib.add_positions(np.zeros((1, 4)), np.zeros((8, 4)), v),
    "RotaryPositions": lambda v, c: kvlib.RotaryPositions(v, 4),
    "attention_mask": lambda v, c: kvlib.attention_mask(v, [0, 1]),
    "causal_mask": lambda v, c: kvlib.causal_mask(v),
    "split_heads": lambda v, c: kvlib.split_heads(np.zeros((2, 4)), v),
    "project_qkv": lambda v, c: kvlib.project_qkv(v, PARAMS.layers[0]),
}
CONFIG_FIELDS = ["vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "context_length",
                 "dtype", "positions", "norm", "bias", "norm_epsilon", "n_kv_heads",
                 "rope_base", "latent_dim", "rope_head_dim", "window", "sink_tokens"]


def _config_with(field):
    return lambda v, c: kvlib.ModelConfig(**{field: v})


CALLS |= {f"ModelConfig {field}": _config_with(field) for field in CONFIG_FIELDS}


def raised_by_kvlib(error: BaseException) -> bool:
    return traceback.extract_tb(error.__traceback__)[-1].filename.startswith(KVLIB)


@pytest.mark.parametrize("name", sorted(CALLS))
@given(value=ODD)
@settings(max_examples=60, deadline=None)
def test_odd_input_gets_a_result_or_a_clear_error_and_changes_no_cache(name, value):
    cache = fresh_cache()
    before = state(cache)
    try:
        CALLS[name](value, cache)
    except (ValueError, TypeError) as error:
        assert raised_by_kvlib(error), f"{name}({value!r}) raised deep inside: {error!r}"
        assert len(str(error)) > 15, f"{name}({value!r}) raised a terse error: {error!r}"
        assert same_state(state(cache), before), f"{name}({value!r}) failed but changed the cache"
    except Exception as error:   # anything else is a bug
        pytest.fail(f"{name}({value!r}) raised {type(error).__name__}: {error}")


def test_a_huge_workload_does_not_overflow():
    # numpy int32 inputs: 80 layers, d 8192, 2**20 tokens, batch 64 is far past 2**31
    n = kvlib.kv_cache_bytes(np.int32(80), np.int32(8192), np.int32(2**20), np.int32(64))
    assert n == 2 * 80 * 8192 * 2**20 * 64 * 2
    with pytest.raises(ValueError, match="n_kv_heads must be at least 1"):
        kvlib.kv_cache_bytes(2, None, 10, n_kv_heads=-2, head_dim=-4)


def test_choosing_from_bad_logits_is_refused():
    with pytest.raises(ValueError, match="last row"):
        kvlib.choose_next_token(np.zeros((5, 12)))
    for bad in ([np.nan, 1.0], [-np.inf, -np.inf]):
        with pytest.raises(ValueError, match="finite"):
            kvlib.choose_next_token(bad, temperature=1.0)
    # a tiny temperature is greedy in the limit, not NaN
    p = kvlib.next_token_probabilities([1.0, 3.0, 2.0], temperature=1e-308)
    np.testing.assert_array_equal(p, [0, 1, 0])
    with pytest.raises(ValueError, match="top_k must be at most 2"):
        kvlib.choose_next_token([1.0, 2.0], temperature=0, top_k=5)


def test_flags_that_are_not_booleans_are_refused():
    for call in (lambda: kvlib.generate(PARAMS, [0], 2, use_cache="no"),
                 lambda: TOY.encode("How", add_bos="no")):
        with pytest.raises(TypeError, match="True or False"):
            call()
    with pytest.raises(ValueError, match="more than once"):
        kvlib.ToyTokenizer(("<bos>", "A", "a"))


def test_rotary_angles_and_rotations_refuse_what_they_cannot_turn():
    for dim in (0, -2):
        with pytest.raises(ValueError, match="dim must be at least 2"):
            kvlib.rotary_angles([0, 1], dim)
    with pytest.raises(ValueError, match="dim must be even"):
        kvlib.rotary_angles([0, 1], 3)
    for dim in (2.0, True, "2"):
        with pytest.raises(TypeError, match="whole number"):
            kvlib.rotary_angles([0, 1], dim)
    for base in (0, -1, math.nan, math.inf, 10**400):
        with pytest.raises(ValueError, match="base must be a (positive|finite) number|too large"):
            kvlib.rotary_angles([0, 1], 2, base)
    with pytest.raises(TypeError, match="base must be a number"):
        kvlib.rotary_angles([0, 1], 2, "1")
    angles = kvlib.rotary_angles([0, 1], 2)
    for rotate in (kvlib.rotate_pairs, kvlib.rotate_halves):
        with pytest.raises(TypeError, match="float array"):
            rotate(np.ones((2, 4), dtype=int), angles)


# ------------------------------------------------------------------ every public function

ARRAYS = st.sampled_from([
    np.array(["a", "b"]), np.array([1, None], dtype=object), np.array([1 + 2j]),
    np.array([True, False]), np.array(3), np.array([2**40]), np.array([np.nan, 1.0]),
    np.zeros((0, 4)), np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((1, 4), np.float32),
    np.zeros((2, 2, 2)), np.full((3, 4), np.inf), np.arange(5), np.array([[1, 2]]),
    np.ones((3, 4), dtype=np.int64), np.ones((2, 3, 2)), np.ones((1, 12)),
])
WIDE_ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70),
    st.sampled_from([2**31, 2**63, 2**70, -(2**70), 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.binary(max_size=2),
    st.sampled_from([np.int32(3), np.int64(-2), np.float32(0.5), np.float64(np.nan),
                     np.bool_(True), np.uint8(255)]),
    st.lists(st.integers(-2, 12), max_size=5), st.lists(st.booleans(), max_size=3),
    st.lists(st.floats(-2, 2), max_size=3),
    st.sampled_from([[True, 2], [1, [2, 3]], [[1, 2], [3, 4]], [[]], [], [None], ["a", 1],
                     (1.5,), {}, {"a": 1}, {1, 2}, object(), [2**70], [[1, 2], [3]]]),
    ARRAYS, st.just(lambda *args: None),
)


def allowed_error(error: BaseException) -> bool:
    """kvlib's own ValueError or TypeError (raised by a raise statement in kvlib, with words),
    a MemoryError that kvlib raises when a pool or an arena has no room, or an OSError that
    names a file (a missing checkpoint, a folder given as a file)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    ours = frame.filename.startswith(KVLIB) and (frame.line or "").lstrip().startswith("raise")
    if isinstance(error, (ValueError, TypeError, MemoryError)):
        return ours and len(str(error)) > 15
    if isinstance(error, OSError):
        return ours or error.filename is not None
    return False


def has_nonfinite(value) -> bool:
    """True for NaN or infinity, alone or in an array or a list of numbers."""
    if isinstance(value, (float, np.floating)):
        return not math.isfinite(value)
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        return False
    return array.dtype.kind in "fc" and not np.isfinite(array).all()


@pytest.fixture(scope="module", autouse=True)
def in_a_scratch_folder(tmp_path_factory):
    """Text values passed as paths write there, not into the repository."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("fuzz-cwd"))
    yield
    os.chdir(before)


NOT_FUZZED = {
    **dict.fromkeys(["kvlib.roofline.blas_name", "kvlib.roofline.set_blas_threads",
                     "kvlib.roofline.measure_matmul_rate", "kvlib.roofline.measure_matmul_rows",
                     "kvlib.roofline.measure_read_bandwidth", "kvlib.roofline.time_appends",
                     "kvlib.roofline.time_cached_generation",
                     "kvlib.roofline.time_recomputation", "kvlib.hardware.measure_machine",
                     "kvlib.hardware.MachineRates.describe"],
                    "measure this machine (or set its BLAS threads): no timings in the tests"),
    **dict.fromkeys(["kvlib.checkpoints.smollm2.load_smollm2",
                     "kvlib.checkpoints.smollm2.smollm2_tokenizer",
                     "kvlib.checkpoints.gguf.read_gguf", "kvlib.bpe.Tokenizer.apply_chat_template",
                     "kvlib.chat.Conversation", "kvlib.chat.Conversation.say",
                     "kvlib.chat.Conversation.reset", "kvlib.chat.Conversation.rendered_ids"],
                    "need SmolLM2's files (a GGUF file, a chat model's tokenizer): "
                    "tests/test_model_of_today.py and tests/test_smollm2.py try their odd input"),
    **dict.fromkeys(["kvlib.checkpoints.gemma3.load_gemma3",
                     "kvlib.checkpoints.gemma3.gemma3_tokenizer"],
                    "need Gemma 3's files: tests/test_gemma3.py and tests/test_model_files.py "
                    "try their odd input"),
    **dict.fromkeys([f"kvlib.eviction.{policy}.{method}"
                     for policy in ("Window", "Sinks", "H2O", "TOVA", "SnapKV")
                     for method in ("keep", "check")],
                    "a policy's step, called by EvictingCache with arrays and a budget it has "
                    "read and built itself (keeping_what_attention_reads calls keep once on "
                    "well-formed arrays, to compare with its own lines); it trusts its "
                    "caller, as kvlib's internals do. tests/test_eviction.py and "
                    "tests/test_keeping_what_attention_reads.py run it on random inputs"),
    "kvlib.config.ModelConfig.held_positions": "in the scope by its name only: "
    "keeping_what_attention_reads calls an EvictingCache's held_positions(layer); the "
    "config's, the rows a window keeps of n positions, is called by kvlib's caches with their "
    "own lengths",
    **dict.fromkeys(["kvlib.eviction.EvictingLayer.append", "kvlib.eviction.EvictingLayer.state",
                     "kvlib.gemma3.EvictingCacheLayer.update"],
                    "in the scope by their names only (the notebooks call append, state and "
                    "update on other caches): one layer of an evicting cache, which the cache "
                    "calls with rows it has checked; tests/test_eviction.py tries them"),
    **{f"kvlib.cache_bugs.{name}": "the bug zoo: loops with bugs planted on purpose, which "
       "kvlib.debug.first_divergence runs and whose crashes it reports as findings"
       for name in ("CacheNeverRead", "JumpingOffset", "PrefixCacheWithoutParent", "RolledBack",
                    "RotaryTableForPrompt", "SharedBatchPosition", "decode_step",
                    "decode_step_mask_from_the_top", "decode_step_window_one_short",
                    "prefill", "prefill_without_mask")},
}
"""Names of the scope without a case, and why."""


def qualified_name(function) -> str:
    """module.qualname of a function, a bound method or a class."""
    function = getattr(function, "__func__", function)
    return f"{function.__module__}.{function.__qualname__}"


def test_the_scope_is_what_the_notebooks_call():
    """tests/fuzz_scope.py is what tools/learner_names.py finds in the notebooks today."""
    found, listed = set(learner_names.learner_names()), set(LEARNER_NAMES)
    assert found == listed, (f"remake tests/fuzz_scope.py (python tools/learner_names.py "
                             f"--module): new {sorted(found - listed)}, gone "
                             f"{sorted(listed - found)}")


def test_the_table_covers_the_scope_and_only_it():
    """A name of the scope gets a valid call in tests/fuzz_api_cases.py, or a reason in
    NOT_FUZZED; outside kvlib.serving, a name outside the scope gets no case: a function no
    learner calls trusts its callers, and the fuzz holds no verdict on it."""
    covered = {qualified_name(build().function) for build in CASES.values()}
    scope = {name for name in LEARNER_NAMES if not name.startswith("kvlib.serving")}
    missing = sorted(scope - covered - NOT_FUZZED.keys())
    assert not missing, f"no valid call in tests/fuzz_api_cases.py for {missing}"
    outside = sorted(name for name in covered - scope if not name.startswith("kvlib.serving"))
    assert not outside, f"cases for names no learner calls: {outside}"
    assert not NOT_FUZZED.keys() - set(LEARNER_NAMES), "NOT_FUZZED names outside the scope"


def test_the_table_has_every_public_function_of_serving():
    """kvlib.serving's scope is every public function and class of its modules: each gets a
    valid call in tests/fuzz_api_cases.py, or a reason in SERVING_NOT_FUZZED."""
    covered = {getattr(build().function, "__func__", build().function) for build in CASES.values()}
    modules = [importlib.import_module(info.name) for info in
               pkgutil.walk_packages(kvlib.serving.__path__, "kvlib.serving.")]
    public = {value: name for module in modules for name, value in vars(module).items()
              if not name.startswith("_") and callable(value)
              and getattr(value, "__module__", "") == module.__name__}
    missing = sorted(name for value, name in public.items()
                     if value not in covered and name not in SERVING_NOT_FUZZED)
    assert not missing, f"no valid call in tests/fuzz_api_cases.py for {missing}"


def test_every_valid_call_of_the_table_succeeds():
    """The fuzz swaps one argument of these calls: each must be valid as it stands."""
    for name, build in CASES.items():
        case = build()
        try:
            case.function(*case.args, **case.kwargs)
        except Exception as error:
            pytest.fail(f"the valid call of {name} fails: {type(error).__name__}: {error}")


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
@settings(max_examples=int(os.environ.get("KVLIB_FUZZ_EXAMPLES", 12)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
def test_every_public_function_answers_odd_input(name, data):
    case = CASES[name]()
    if not case.slots():
        return
    slot = data.draw(st.sampled_from(case.slots()), label="argument")
    value = data.draw(WIDE_ODD, label="value")
    value = value if callable(value) else copy.deepcopy(value)   # calls may append to lists
    before = case.state() if case.state else None
    # NaN and infinity in, NaN and infinity out: numpy's warnings about them are not errors
    quiet = np.errstate(all="ignore") if has_nonfinite(value) else contextlib.nullcontext()
    try:
        with quiet:
            case.call_with(slot, value)
    except Exception as error:
        assert allowed_error(error), (
            f"{name}, argument {slot} = {value!r:.80}: {type(error).__name__}: {error}\n"
            + "".join(traceback.format_tb(error.__traceback__)[-2:]))
        if case.state:
            assert same(case.state(), before), \
                f"{name}, argument {slot} = {value!r:.80} failed but changed the state"
