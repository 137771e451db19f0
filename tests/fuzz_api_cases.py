"""A valid call of every name a learner calls (tests/fuzz_scope.py: the notebooks' code cells
and the exercises' solutions), and of kvlib.serving's public functions (its worker decides its
scope), for the fuzz in tests/test_fuzz.py: the fuzz swaps one argument of a valid call for an
odd value (a string, None, a bool, nan, a huge int, an object array, a wrong shape) and
requires a result or kvlib's own clear error, with nothing changed.

A case is built fresh for each call (CASES[name]() -> Case), so that a stateful method runs
on new objects and its state can be compared before and after a failing call.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

import kvlib
from kvlib import chat, debug, gemma3, gpt2, grouped, heads, latent, positions, precision, roofline
from kvlib.checkpoints import gguf, llama, safetensors, smollm2
from kvlib.checkpoints.gemma3 import Gemma3Config
from kvlib.flops import generation_step_multiply_adds
from kvlib.memory import ModelPreset, tokens_that_fit
from kvlib.roofline import (
    arithmetic_intensity,
    cache_bytes,
    decode_step_bytes,
    forward_bytes,
    generation_step_times,
    matmul_intensity,
)
from kvlib.roofline import weights_bytes as roofline_weights_bytes
from kvlib.serving import (
    BlockAllocator,
    ContiguousArena,
    PagedKVCache,
    PerChannel,
    PerToken,
    PoolTimeline,
    PrefixServer,
    QuantizedKVCache,
    batch,
    block_keys,
    memory_plan,
    quantized,
    scheduler,
    speculative,
    workloads,
)
from kvlib.serving.request import requests_of_lengths
from kvlib.stories import StoryTokenizer, corpus, grammar

# ------------------------------------------------------------------------------ models

TOY = kvlib.init_params()
GPT = kvlib.init_params(kvlib.ModelConfig(positions="learned", norm="layer", bias=True))
ROTARY = kvlib.init_params(kvlib.ModelConfig(positions="rotary", n_kv_heads=1))
WINDOWED = kvlib.init_params(kvlib.ModelConfig(positions="rotary", window=3, sink_tokens=1))
LATENT = kvlib.init_params(kvlib.ModelConfig(positions="rotary", latent_dim=3,
                                             rope_head_dim=2))
LLAMA = kvlib.init_params(kvlib.ModelConfig(positions="rotary", norm="rms", mlp="swiglu",
                                            rope_pairing="half"))
DRAFT = kvlib.init_params(kvlib.ModelConfig(n_layers=1), seed=7)
CONFIG = TOY.config
PROMPT = [0, 3, 7, 1, 9]
X = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
HEADS = np.linspace(-1.0, 1.0, 12).reshape(2, 3, 2)          # (h, T, dh)
TOY_TOKENIZER = kvlib.ToyTokenizer()
GPT2_TOKENIZER = gpt2.Tokenizer.gpt2()

# ------------------------------------------------------------------------------ files

_FILES = Path(tempfile.mkdtemp(prefix="kvlib-fuzz-"))
atexit.register(shutil.rmtree, _FILES, ignore_errors=True)
CHECKPOINT = gpt2.save(GPT, _FILES / "gpt2")
TENSORS = _FILES / "tensors.safetensors"
safetensors.write_safetensors(TENSORS, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                                        "b": np.arange(3, dtype=np.int64)}, {"k": "v"})


def output_path(name: str) -> Path:
    """A fresh path for a file the call writes."""
    return Path(tempfile.mkdtemp(dir=_FILES)) / name


# ------------------------------------------------------------------------------ state

def cache_state(cache):
    """What a cache holds: its lengths and every layer's keys and values."""
    cache.check_consistent()
    return (cache.lengths, [(np.array(cache.keys(i)), np.array(cache.values(i)))
                            for i in range(cache.config.n_layers)])


def pool_state(pool: BlockAllocator):
    return pool.ref_counts.tolist(), list(pool.free), list(pool.idle), dict(pool.cached)


def same(a, b) -> bool:
    """Deep equality of states made of tuples, lists, dicts and arrays (NaN equals NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b, equal_nan=np.asarray(a).dtype.kind == "f")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


# ------------------------------------------------------------------------------ cases

@dataclass
class Case:
    """A valid call: function(*args, **kwargs); state() says what a failing call must leave
    unchanged (None for a pure function)."""

    function: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    state: Callable[[], Any] | None = None

    def slots(self) -> list:
        """The arguments the fuzz may replace: positions, then keyword names."""
        return list(range(len(self.args))) + list(self.kwargs)

    def call_with(self, slot, value):
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(slot, int):
            args[slot] = value
        else:
            kwargs[slot] = value
        return self.function(*args, **kwargs)


CASES: dict[str, Callable[[], Case]] = {}


def case(name: str):
    def register(build):
        CASES[name] = build
        return build
    return register


def pure(name: str, function, *args, **kwargs) -> None:
    CASES[name] = lambda: Case(function, args, kwargs)


def prefilled(params=TOY, ids=PROMPT):
    return kvlib.prefill(params, ids)[1]


# ---- the core: model steps, inference, caches (notebooks 00-11) ----------------------------

layer = TOY.layers[0]
pure("embed", kvlib.embed, np.array([0, 3]), TOY.embedding)
pure("project_qkv", kvlib.project_qkv, X, layer)
pure("split_heads", kvlib.split_heads, X, 2)
pure("merge_heads", kvlib.merge_heads, HEADS)
pure("causal_mask", kvlib.causal_mask, 2, 3)
pure("attention_mask", kvlib.attention_mask, [1, 2], [0, 1, 2], 2, 1)
pure("attention_scores", kvlib.attention_scores, HEADS, HEADS)
pure("apply_mask", kvlib.apply_mask, np.zeros((2, 3, 3)), kvlib.causal_mask(3))
pure("softmax", kvlib.softmax, X, -1)
pure("attention_weights", kvlib.attention_weights, HEADS, HEADS, kvlib.causal_mask(3))
pure("weighted_sum", kvlib.weighted_sum, np.full((2, 3, 3), 1 / 3), HEADS)
pure("attention", kvlib.attention, HEADS, HEADS, HEADS, kvlib.causal_mask(3))
pure("output_projection", kvlib.output_projection, X, layer.Wo, np.zeros(4))
pure("gelu", kvlib.gelu, X)
pure("swiglu_mlp", kvlib.swiglu_mlp, X, LLAMA.layers[0])
pure("mlp", kvlib.mlp, X, layer)
pure("layer_norm", kvlib.layer_norm, X, np.ones(4), np.zeros(4), 1e-5)
pure("rms_norm", kvlib.rms_norm, X, np.ones(4), 1e-5)
pure("normalize", kvlib.normalize, X, np.ones(4), np.zeros(4), 1e-5)
pure("decoder_block", kvlib.decoder_block, X, layer, 2, kvlib.causal_mask(3))
pure("unembed", kvlib.unembed, X, TOY.embedding)
pure("forward", kvlib.forward, TOY, PROMPT, last_only=False, record_attention=[])
pure("next_token_probabilities", kvlib.next_token_probabilities, [1.0, 2.0, 0.5], 1.0, 2)
pure("next_token_losses", kvlib.next_token_losses, np.zeros((3, 12)), [0, 3, 7])
pure("choose_next_token", kvlib.choose_next_token, [1.0, 2.0, 0.5], 1.0, 2,
     np.random.default_rng(0))
pure("generate", kvlib.generate, TOY, PROMPT, 3, True, 1.0, 4, 0)
pure("init_params", kvlib.init_params, CONFIG, 3)
pure("ModelConfig", kvlib.ModelConfig, 12, 4, 2, 3, 8, 32)
pure("with_config", TOY.with_config, window=4)
pure("kv_cache_bytes", kvlib.kv_cache_bytes, 2, 8, 10, 1, 2)
pure("latent_cache_bytes", kvlib.latent_cache_bytes, 2, 8, 2, 10, 1, 2)
pure("config_cache_bytes", kvlib.config_cache_bytes, CONFIG, 10, 2, 4)
pure("tokens_that_fit", tokens_that_fit, 10**6, 10**5, 100)
PRESET = ModelPreset("m", 2, 8, 2, 1, 4, 16, 100, "here", window=6)
pure("ModelPreset.kv_cache_bytes", PRESET.kv_cache_bytes, 10, 1, 2)
pure("ModelPreset.kv_bytes_per_token", PRESET.kv_bytes_per_token, 2)
pure("ModelPreset.mha_bytes_per_token", PRESET.mha_bytes_per_token, 2)
pure("ModelPreset.weights_bytes", PRESET.weights_bytes, 2)
pure("forward_multiply_adds", kvlib.forward_multiply_adds, CONFIG, 5, False)
pure("prefill_multiply_adds", kvlib.prefill_multiply_adds, CONFIG, 5, 2, False)
pure("decode_step_multiply_adds", kvlib.decode_step_multiply_adds, CONFIG, 5)
pure("generation_multiply_adds", kvlib.generation_multiply_adds, CONFIG, 5, 3, True)
pure("generation_step_multiply_adds", generation_step_multiply_adds, CONFIG, 5, 3, False)
pure("count_multiply_adds", kvlib.count_multiply_adds, kvlib.forward, TOY, PROMPT)
pure("roofline.weights_bytes", roofline_weights_bytes, CONFIG)
pure("cache_bytes", cache_bytes, CONFIG, 5)
pure("decode_step_bytes", decode_step_bytes, CONFIG, 5)
pure("forward_bytes", forward_bytes, CONFIG, 5)
pure("arithmetic_intensity", arithmetic_intensity, 1e6, 1e5)
pure("matmul_intensity", matmul_intensity, 4, 8, 16, 4)
pure("generation_step_times", generation_step_times, CONFIG, 5, 3, True, 1e9, 1e8)
pure("ToyTokenizer", kvlib.ToyTokenizer, kvlib.TOY_VOCABULARY)
pure("ToyTokenizer.encode", TOY_TOKENIZER.encode, "How are you?", True)
pure("ToyTokenizer.decode", TOY_TOKENIZER.decode, PROMPT)
pure("ToyTokenizer.tokens", TOY_TOKENIZER.tokens, PROMPT)
pure("Tokenizer.encode", GPT2_TOKENIZER.encode, "Hello there")
pure("Tokenizer.decode", GPT2_TOKENIZER.decode, [15496, 612])
pure("Tokenizer.tokens", GPT2_TOKENIZER.tokens, [15496, 612])
pure("make_cache", kvlib.make_cache, CONFIG, 8)
pure("KVCache", kvlib.KVCache, CONFIG, 8)
pure("ConcatenatingKVCache", kvlib.ConcatenatingKVCache, CONFIG, 8)
pure("SlidingWindowCache", kvlib.SlidingWindowCache, WINDOWED.config)
pure("LatentKVCache", kvlib.LatentKVCache, LATENT.config, 8)


def _cache_cases(label: str, make, width: int, params=TOY, keep: int = 2) -> None:
    """append, keys, values, truncate, key_positions of a prefilled cache of one kind."""
    rows = np.full((1, width), 0.5)

    def method(name, *args):
        def build():
            cache = make()
            kvlib.prefill(params, PROMPT, cache)
            return Case(getattr(cache, name), args, state=lambda: cache_state(cache))
        CASES[f"{label}.{name}"] = build

    method("append", 1, rows, rows)
    method("keys", 1)
    method("values", 1)
    method("truncate", keep)
    method("key_positions", 2)


_cache_cases("KVCache", lambda: kvlib.KVCache(CONFIG), 4)
_cache_cases("ConcatenatingKVCache", lambda: kvlib.ConcatenatingKVCache(CONFIG), 4)
_cache_cases("SlidingWindowCache", lambda: kvlib.SlidingWindowCache(WINDOWED.config), 4,
             WINDOWED, keep=5)
_cache_cases("PagedKVCache", lambda: PagedKVCache(BlockAllocator(CONFIG, 8, 2)), 4)
_cache_cases("QuantizedKVCache", lambda: QuantizedKVCache(CONFIG, PerChannel(8, 2)), 4)


@case("LatentKVCache.append")
def _():
    cache = prefilled(LATENT)
    return Case(cache.append, (1, np.full((1, 3), 0.5), np.full((1, 2), 0.5)),
                state=lambda: cache_state(cache))


@case("prefill")
def _():
    cache = prefilled()
    return Case(kvlib.prefill, (TOY, [2, 4], cache), dict(last_only=True, record_attention=[]),
                state=lambda: cache_state(cache))


@case("decode_step")
def _():
    cache = prefilled()
    return Case(kvlib.decode_step, (TOY, 4, cache), dict(record_attention=[]),
                state=lambda: cache_state(cache))


@case("decode_step windowed")
def _():
    cache = prefilled(WINDOWED)
    return Case(kvlib.decode_step, (WINDOWED, 4, cache), state=lambda: cache_state(cache))


@case("decode_step latent")
def _():
    cache = prefilled(LATENT)
    return Case(kvlib.decode_step, (LATENT, 4, cache), state=lambda: cache_state(cache))


# ---- Gemma 3: local and global layers (notebook 26) ---------------------------------------

GEMMA3_TINY = gemma3.init_gemma3_params(Gemma3Config(
    vocab_size=12, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    layer_types=("sliding_attention", "full_attention"), sliding_window=3,
    max_position_embeddings=16))


def gemma3_cache_state(cache):
    return [(layer.length, np.array(cache.keys(i)), np.array(cache.values(i)))
            for i, layer in enumerate(cache.layers)]


def gemma3_prefilled():
    return gemma3.prefill(GEMMA3_TINY, PROMPT, last_only=True)[1]


pure("gemma3.forward", gemma3.forward, GEMMA3_TINY, PROMPT, last_only=True)
pure("gemma3.generate", gemma3.generate, GEMMA3_TINY, PROMPT, 3)
pure("Gemma3Config.replace", GEMMA3_TINY.config.replace, sliding_window=4)
pure("local_global_cache_bytes", kvlib.local_global_cache_bytes, (3, None), 10, 1, 4, 1, 2)
ROWS = np.ones((2, GEMMA3_TINY.config.kv_width))


@case("RingCacheLayer.update")
def _():
    return Case(gemma3.RingCacheLayer(3, 4, np.float64).update, (ROWS, ROWS))


@case("FullCacheLayer.update")
def _():
    return Case(gemma3.FullCacheLayer(8, 4, np.float64).update, (ROWS, ROWS))


@case("gemma3.prefill")
def _():
    cache = gemma3_prefilled()
    return Case(gemma3.prefill, (GEMMA3_TINY, [2, 4], cache), dict(last_only=True),
                state=lambda: gemma3_cache_state(cache))


@case("gemma3.decode_step")
def _():
    cache = gemma3_prefilled()
    return Case(gemma3.decode_step, (GEMMA3_TINY, 4, cache),
                state=lambda: gemma3_cache_state(cache))


# ---- positions, grouped-query and latent attention (notebooks 12-17) ----------------------

ANGLES = positions.rotary_angles([0, 1, 2], 2)
pure("add_positions", kvlib.add_positions, X, GPT.position_table, [0, 1, 2])
pure("rotary_angles", kvlib.rotary_angles, [0, 1, 2], 2, 10000.0)
pure("rotate_pairs", kvlib.rotate_pairs, X, ANGLES)
pure("rotate_halves", kvlib.rotate_halves, X, ANGLES)
pure("RotaryPositions", kvlib.RotaryPositions, np.arange(3), 2, 10000.0, "half")
pure("RotaryPositions.rotate", kvlib.RotaryPositions(np.arange(3), 2).rotate, X)
pure("rotary_positions", kvlib.rotary_positions, ROTARY.config, [0, 1, 2])
pure("group_size", grouped.group_size, 8, 2)
pure("query_groups", grouped.query_groups, 8, 2)
pure("repeat_kv_heads", grouped.repeat_kv_heads, HEADS[:1], 2)
pure("repeated_attention", grouped.repeated_attention, HEADS, HEADS[:1], HEADS[:1],
     kvlib.causal_mask(3))
pure("duplicate_kv_heads", grouped.duplicate_kv_heads, ROTARY)
pure("mean_pool_kv_heads", grouped.mean_pool_kv_heads, TOY, 1)

LATENT_LAYER = LATENT.layers[0]
ROTATION = kvlib.rotary_positions(LATENT.config, [0, 1, 2])
LATENTS = np.linspace(-1, 1, 9).reshape(3, 3)
pure("compress_kv", latent.compress_kv, X, LATENT_LAYER)
pure("rebuild_kv", latent.rebuild_kv, LATENTS, LATENT_LAYER)
pure("latent_queries", latent.latent_queries, X, LATENT_LAYER, ROTATION)
pure("rope_keys", latent.rope_keys, X, LATENT_LAYER, ROTATION)
pure("per_head", latent.per_head, LATENT_LAYER.W_up_k, 2)
pure("absorb_queries", latent.absorb_queries, HEADS, LATENT_LAYER, 2)
pure("latent_attention_scores", latent.latent_attention_scores, np.zeros((2, 3, 3)), LATENTS,
     np.zeros((2, 3, 2)), np.zeros((3, 2)), 0.5)
pure("expand_values", latent.expand_values, np.zeros((2, 3, 3)), LATENT_LAYER, 2)
pure("latent_attention", latent.latent_attention, X, LATENT_LAYER, 2, kvlib.causal_mask(3),
     rotary=ROTATION)
pure("latent_attention_rebuilt", latent.latent_attention_rebuilt, X, LATENT_LAYER, 2,
     kvlib.causal_mask(3), rotary=ROTATION)

# ---- checkpoints (notebooks 12, 14, 18) ---------------------------------------------------

pure("gpt2.load", gpt2.load, CHECKPOINT, "float64")
pure("find_weights", gpt2.find_weights, _FILES)
pure("read_safetensors", safetensors.read_safetensors, TENSORS, memory_map=False)
GGUF_METADATA = {"general.architecture": "llama", "llama.attention.head_count": 2,
                 "llama.attention.head_count_kv": 1, "llama.embedding_length": 8,
                 "llama.block_count": 2, "llama.feed_forward_length": 16,
                 "llama.context_length": 32, "llama.attention.layer_norm_rms_epsilon": 1e-5,
                 "llama.vocab_size": 12}
pure("config_from_gguf", gguf.config_from_gguf, GGUF_METADATA, "float64")
pure("bits_per_number", gguf.bits_per_number, "Q4_1")
pure("converted_directory", gguf.converted_directory, _FILES / "model.gguf")
pure("find_gguf", smollm2.find_gguf, _FILES)
pure("smollm2.measured", smollm2.measured)
pure("to_interleaved_columns", llama.to_interleaved_columns, np.arange(16.0).reshape(2, 8), 2)
pure("to_half_columns", llama.to_half_columns, np.arange(16.0).reshape(2, 8), 2)
pure("with_rope_pairing", llama.with_rope_pairing, LLAMA, "interleaved")

# ---- what the notebooks use beside the model: chat, debugging, precision (notebooks 09-25) --

pure("ModelConfig.replace", CONFIG.replace, d_model=8, n_heads=4)
pure("Params.arrays", TOY.arrays)
pure("LayerParams.arrays", TOY.layers[0].arrays)
pure("LatentLayerParams.arrays", LATENT.layers[0].arrays)
pure("MultiplyAdds.as_dict", kvlib.forward_multiply_adds(CONFIG, 3).as_dict)
pure("Tokenizer.gpt2", kvlib.Tokenizer.gpt2)
pure("batched_step_cost", roofline.batched_step_cost, CONFIG, 4, 5, 2)
pure("reusable_prefix", chat.reusable_prefix, [1, 2, 3], [1, 2, 4])
pure("relative_difference", debug.relative_difference, np.ones((1, 3)), np.full((1, 3), 2.0))
pure("first_divergence", debug.first_divergence, ROTARY, PROMPT, 3, tolerance=1e-6)
pure("rows_computed", debug.rows_computed, TOY, PROMPT, 3)
pure("tolerance_for", debug.tolerance_for, "bfloat16", "smollm2")
pure("measured_tolerances", debug.measured_tolerances)
pure("compare", precision.compare, np.eye(3), np.eye(3)[::-1])
pure("Comparison.as_dict", precision.compare(np.eye(3), np.eye(3)).as_dict)
pure("computed_in", precision.computed_in, "bfloat16")
pure("in_format", precision.in_format, TOY, "bfloat16")
pure("left_padded", precision.left_padded, TOY, PROMPT, 2, 0)
pure("teacher_forced", precision.teacher_forced, TOY, PROMPT, 3)
pure("story_sequences", corpus.story_sequences, 2, 0, 8)
pure("generate_stories", grammar.generate_stories, 2, 0)
STORY = grammar.generate_stories(1, 0)[0]
pure("first_error", grammar.first_error, STORY, False)
pure("is_grammatical", grammar.is_grammatical, STORY, False)
pure("text_to_words", grammar.text_to_words, STORY)
pure("forced_repeats", grammar.forced_repeats, grammar.text_to_words(STORY),
     sorted(grammar.REPEATED_SLOTS)[0])
STORY_TOKENIZER = StoryTokenizer()
pure("StoryTokenizer", StoryTokenizer)
pure("StoryTokenizer.encode", STORY_TOKENIZER.encode, STORY, True)
pure("StoryTokenizer.decode", STORY_TOKENIZER.decode, STORY_TOKENIZER.encode(STORY))
pure("StoryTokenizer.tokens", STORY_TOKENIZER.tokens, STORY_TOKENIZER.encode(STORY))
pure("stories.load_model", kvlib.stories.load_model, "stories-draft", "float32")

TWICE = PROMPT[:3] * 2                                   # a piece of 3 tokens said twice
TWICE_RECORDED: list = []
TWICE_LOGITS = kvlib.forward(TOY, TWICE, record_attention=TWICE_RECORDED)
STORY_WORDS = grammar.text_to_words(STORY)
STORY_WEIGHTS = np.tril(np.ones((len(STORY_WORDS),) * 2))
STORY_WEIGHTS = [np.broadcast_to(STORY_WEIGHTS / STORY_WEIGHTS.sum(-1, keepdims=True),
                                 (2, *STORY_WEIGHTS.shape))]      # one layer of 2 heads
pure("previous_token_scores", heads.previous_token_scores, TWICE_RECORDED)
pure("induction_scores", heads.induction_scores, TWICE_RECORDED, 3)
pure("copied_fraction", heads.copied_fraction, TWICE_LOGITS, TWICE, 3)
pure("forced_name_weights", heads.forced_name_weights, STORY_WEIGHTS,
     grammar.forced_repeats(STORY_WORDS, "name"))
pure("best_head", heads.best_head, np.arange(6.0).reshape(3, 2))
pure("distances_read", heads.distances_read, TWICE_RECORDED[0][0], [1, 2])
pure("roofline_time", roofline.roofline_time, 1e9, 1e8, 1e12, 1e9)


def _cache_state_cases(label: str, make, params=TOY) -> None:
    """checkpoint, restore and reset of a prefilled cache of one kind."""
    def build_checkpoint():
        cache = make()
        kvlib.prefill(params, PROMPT, cache)
        return Case(cache.checkpoint, state=lambda: cache_state(cache))

    def build_restore():
        cache = make()
        kvlib.prefill(params, PROMPT, cache)
        saved = cache.checkpoint()
        kvlib.decode_step(params, 2, cache)
        return Case(cache.restore, (saved,), state=lambda: cache_state(cache))

    CASES[f"{label}.checkpoint"] = build_checkpoint
    CASES[f"{label}.restore"] = build_restore


_cache_state_cases("KVCache", lambda: kvlib.KVCache(CONFIG))
_cache_state_cases("SlidingWindowCache", lambda: kvlib.SlidingWindowCache(WINDOWED.config),
                   WINDOWED)
_cache_state_cases("ConcatenatingKVCache", lambda: kvlib.ConcatenatingKVCache(CONFIG))
CASES["KVCache.reset"] = lambda: Case(prefilled().reset)
CASES["RoundingCache.append"] = lambda: (lambda cache: Case(
    cache.append, (0, np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)),
    state=lambda: cache_state(cache)))(precision.RoundingCache(CONFIG, "bfloat16"))
for _name, _args in (("keys", (1,)), ("values", (1,)), ("truncate", (2,))):
    def _build(name=_name, args=_args):
        cache = prefilled(LATENT)
        return Case(getattr(cache, name), args, state=lambda: cache_state(cache))
    CASES[f"LatentKVCache.{_name}"] = _build

# ---- serving: the paged cache (notebook 19) ----------------------------------------------
# Only the serving names the notebooks call (19-24) are fuzzed: they check their input at
# the door; what kvlib calls inside trusts its callers (SERVING_NOT_FUZZED).

pure("BlockAllocator", BlockAllocator, CONFIG, 4, 2)
pure("PagedKVCache", PagedKVCache, BlockAllocator(CONFIG, 4, 2))
pure("request_mix", memory_plan.request_mix, 4, 64, 1, 1.0, 2)
pure("blocks_for", memory_plan.blocks_for, 10, 4)
pure("slack", memory_plan.slack, 10, 4)
pure("memory_table", memory_plan.memory_table, [5, 9], [2, 4], 16, 2)
pure("parallel_sampling_blocks", memory_plan.parallel_sampling_blocks, 10, 4, 3, 4)
pure("separate_sampling_blocks", memory_plan.separate_sampling_blocks, 10, 4, 3, 4)
pure("ContiguousArena", ContiguousArena, 16)


def _arena():
    arena = ContiguousArena(16)
    arena.reserve(0, 4)
    return arena


CASES["ContiguousArena.reserve"] = lambda: (lambda arena: Case(
    arena.reserve, (1, 5), state=lambda: arena.owners.tolist()))(_arena())
CASES["ContiguousArena.release"] = lambda: (lambda arena: Case(
    arena.release, (0,), state=lambda: arena.owners.tolist()))(_arena())

TIMELINE_REQUESTS = requests_of_lengths([3, 2], [2, 3], [0, 1])
pure("PoolTimeline", PoolTimeline, TOY, TIMELINE_REQUESTS, 6, 2, 1, 0.5)


def _timeline():
    timeline = PoolTimeline(TOY, TIMELINE_REQUESTS, n_blocks=6, block_size=2)
    timeline.step()
    return timeline


def timeline_state(timeline: PoolTimeline):
    return (timeline.step_number, timeline.block_tables(), pool_state(timeline.pool),
            len(timeline.history), [list(s.all_token_ids) for s in timeline.running])


for _name, _args in (("fork", ("A",)), ("run", (3,))):
    def _build(name=_name, args=_args):
        timeline = _timeline()
        return Case(getattr(timeline, name), args, state=lambda: timeline_state(timeline))
    CASES[f"PoolTimeline.{_name}"] = _build

# ---- serving: prefix caching (notebook 20) -----------------------------------------------

pure("block_keys", block_keys, [1, 2, 3, 4, 5], 2)
pure("PrefixServer", PrefixServer, TOY, 8, 2)


def _server():
    server = PrefixServer(TOY, n_blocks=12, block_size=2)
    server.finish(server.admit(PROMPT).request)
    server.admit([0, 3, 7, 2])
    return server


def server_state(server: PrefixServer):
    entries = [(e.key, e.block, e.hits, e.last_used, e.children)
               for e in server.prefix_cache.entries]
    return (pool_state(server.pool), entries, server.prefix_cache.clock,
            {r: (list(run.all_token_ids), list(run.block_table), server.caches[r].lengths)
             for r, run in server.running.items()}, server.n_admitted)


def _server_case(name, method, args):
    def build():
        server = _server()
        target = server.prefix_cache if method.startswith("cache.") else server
        function = getattr(target, method.removeprefix("cache."))
        return Case(function, args, state=lambda: server_state(server))
    CASES[name] = build


_server_case("PrefixServer.admit", "admit", ([0, 3, 7, 1, 2],))
_server_case("PrefixServer.decode", "decode", (1, 4))
_server_case("PrefixServer.finish", "finish", (1,))
_server_case("PrefixCache.match", "cache.match", (PROMPT,))
_server_case("PrefixCache.reusable", "cache.reusable", (PROMPT,))
_server_case("PrefixCache.eviction_order", "cache.eviction_order", (1,))
_server_case("PrefixCache.entry", "cache.entry", (0,))

# ---- serving: batches and schedules (notebook 21) ----------------------------------------


def _batch():
    return [prefilled(), prefilled(TOY, [0, 3])]


@case("batched_decode_step")
def _():
    caches = _batch()
    return Case(batch.batched_decode_step, (TOY, [1, 2], caches),
                dict(attend=batch.attend_padded),
                state=lambda: [cache_state(c) for c in caches])


QUERIES = np.linspace(-1, 1, 8).reshape(2, 4)
KEYS = [np.ones((5, 4)), np.ones((2, 4))]
pure("attend_per_sequence", batch.attend_per_sequence, QUERIES, KEYS, KEYS, [None, None],
     CONFIG)
pure("attend_padded", batch.attend_padded, QUERIES, KEYS, KEYS, [None, None], CONFIG)
pure("padding_mask", batch.padding_mask, [3, 1])
pure("left_pad", batch.left_pad, [[1, 2, 3], [4]], 0)
pure("padded_prompt_mask", batch.padded_prompt_mask, np.array([[True, True], [False, True]]))
pure("padded_prompt_positions", batch.padded_prompt_positions,
     np.array([[True, True], [False, True]]))
pure("batched_step_flops", roofline.batched_step_flops, CONFIG, [3, 5])
pure("batched_step_bytes", roofline.batched_step_bytes, CONFIG, [3, 5], 2)
pure("batched_step_seconds", roofline.batched_step_seconds, CONFIG, [3, 5], 1e9, 1e8, 2)
pure("ridge_point", roofline.ridge_point, 1e12, 1e9)
pure("compute_bound_batch_size", roofline.compute_bound_batch_size, CONFIG, 5, 1e12, 1e9, 2)


WORKLOAD = workloads.make_workload(4, seed=1)
pure("make_workload", workloads.make_workload, 4, 1, 2.0, (2, 5), (1, 4))
pure("StaticBatching", scheduler.StaticBatching, 2, 8)
pure("ContinuousBatching", scheduler.ContinuousBatching, 2, 8)
pure("serve", scheduler.serve, WORKLOAD, scheduler.ContinuousBatching(2))
pure("ModelRunner", scheduler.ModelRunner, TOY)
pure("serve with a model", scheduler.serve, WORKLOAD, scheduler.StaticBatching(2),
     scheduler.ModelRunner(TOY), "steps")


# ---- serving: quantized cache (notebook 22) ----------------------------------------------

ROWS = np.linspace(-1, 1, 12).reshape(3, 4)
SCALES = quantized.symmetric_scales(ROWS, 8, 1)
CODES = quantized.quantize(ROWS, SCALES, 8)
pure("symmetric_scales", quantized.symmetric_scales, ROWS, 8, 1)
pure("quantize", quantized.quantize, ROWS, SCALES, 8)
pure("dequantize", quantized.dequantize, CODES, SCALES, "float32")
pure("round_trip", quantized.round_trip, ROWS, 4, 0)
pure("packed_width", quantized.packed_width, 5, 2)
pure("pack_codes", quantized.pack_codes, CODES, 8)
pure("unpack_codes", quantized.unpack_codes, quantized.pack_codes(CODES, 8), 8, 4)
pure("PerToken", PerToken, 4)
pure("PerChannel", PerChannel, 4, 2)
pure("PerToken.round_trip", PerToken(4).round_trip, ROWS)
pure("PerChannel.round_trip", PerChannel(4, 2).round_trip, ROWS)
pure("PerChannel.nbytes", PerChannel(4, 2).nbytes, 5, 4, 2)
pure("QuantizedKVCache", QuantizedKVCache, CONFIG, PerChannel(4, 2), PerToken(8), 8)
pure("quantized_cache_bytes", quantized.quantized_cache_bytes, CONFIG, 5, PerChannel(4, 2),
     PerToken(8), 2)
pure("quantized.bytes_per_token", quantized.bytes_per_token, 3, 4, PerChannel(4, 2),
     PerToken(8))
pure("with_outlier_key_channels", quantized.with_outlier_key_channels, TOY, [1], 10.0, [0])
pure("next_token_loss", quantized.next_token_loss, np.zeros((3, 12)), [0, 3, 7])
pure("greedy_agreement", quantized.greedy_agreement, np.eye(3), np.eye(3))
pure("plain_logits", quantized.plain_logits, TOY, [PROMPT])
pure("measure_quality", quantized.measure_quality, TOY, [PROMPT], PerChannel(4, 2),
     PerToken(8))


@case("decoded_logits")
def _():
    cache = QuantizedKVCache(CONFIG, PerChannel(4, 2))
    return Case(quantized.decoded_logits, (TOY, PROMPT, cache, 2),
                state=lambda: cache_state(cache))


@case("greedy_tokens")
def _():
    cache = QuantizedKVCache(CONFIG, PerChannel(4, 2))
    return Case(quantized.greedy_tokens, (TOY, PROMPT, 3, cache),
                state=lambda: cache_state(cache))


# ---- serving: speculative decoding (notebook 23) -----------------------------------------

P = np.array([0.5, 0.3, 0.2])
Q = np.array([0.2, 0.3, 0.5])
pure("acceptance_probability", speculative.acceptance_probability, P, Q, 2)
pure("residual_distribution", speculative.residual_distribution, P, Q)
pure("SamplingAcceptance", speculative.SamplingAcceptance, 0.8, 2, 0)
pure("speculative_generate", speculative.speculative_generate, TOY, DRAFT, PROMPT, 4, 2, 1.0,
     5, 0)
pure("expected_tokens_per_pass", speculative.expected_tokens_per_pass, 0.7, 4)
pure("predicted_speedup", speculative.predicted_speedup, 0.7, 4, 0.1)
pure("greedy_agreements", speculative.greedy_agreements, TOY, DRAFT, PROMPT,
     kvlib.generate(TOY, PROMPT, 4))
pure("replay_greedy", speculative.replay_greedy, [True, False, True, True], 2)
pure("outcome_probabilities", speculative.outcome_probabilities, lambda s: P, lambda s: Q,
     (1,), 2)
pure("SpeculativeDecoder", speculative.SpeculativeDecoder, TOY, DRAFT, PROMPT, 2,
     speculative.SamplingAcceptance(seed=0))


def decoder_state(decoder):
    return (list(decoder.sequence), len(decoder.steps), cache_state(decoder.target_cache),
            cache_state(decoder.draft_cache))


for _name, _args in (("step", (2,)), ("generate", (3,))):
    def _build(name=_name, args=_args):
        decoder = speculative.SpeculativeDecoder(TOY, DRAFT, PROMPT, k=2)
        decoder.step()
        return Case(getattr(decoder, name), args, state=lambda: decoder_state(decoder))
    CASES[f"SpeculativeDecoder.{_name}"] = _build


# drafters (notebook 23, on SmolLM2): prompt lookup, a model and its cache, an early exit
SEQUENCE = [1, 2, 3, 1, 2]
pure("first_layers", TOY.first_layers, 2)
pure("prompt_lookup", speculative.prompt_lookup, SEQUENCE, 2, 3, 1)
pure("PromptLookupDrafter", speculative.PromptLookupDrafter, 3, 1)
pure("PromptLookupDrafter.propose", speculative.PromptLookupDrafter().propose, SEQUENCE, 2)
pure("SpeculativeDecoder with prompt lookup", speculative.SpeculativeDecoder, TOY,
     speculative.PromptLookupDrafter(), SEQUENCE, 2)


for _name, _args in (("step", (2,)), ("generate", (3,))):
    def _build(name=_name, args=_args):
        decoder = speculative.SpeculativeDecoder(TOY, speculative.PromptLookupDrafter(),
                                                 SEQUENCE, k=2)
        decoder.step()
        return Case(getattr(decoder, name), args, state=lambda: (
            list(decoder.sequence), len(decoder.steps), cache_state(decoder.target_cache)))
    CASES[f"SpeculativeDecoder.{_name} with prompt lookup"] = _build


@case("propose")
def _():
    cache = prefilled(DRAFT, PROMPT[:-1])
    return Case(speculative.propose, (DRAFT, cache, PROMPT[-1:], 2,
                                      speculative.GreedyAcceptance().choose),
                state=lambda: cache_state(cache))


@case("verify")
def _():
    cache = prefilled(TOY, PROMPT[:-1])
    return Case(speculative.verify, (TOY, cache, PROMPT[-1:], (1, 2)),
                state=lambda: cache_state(cache))


# ---- the engine (notebook 24) --------------------------------------------------------------

from kvlib.serving import block_attention  # noqa: E402
from kvlib.serving import engine as engine_module  # noqa: E402

ENGINE_MODEL = kvlib.init_params(kvlib.ModelConfig(positions="rotary"), seed=24)

pure("SamplingParams", engine_module.SamplingParams, 3, 0.0, None, (2,))
pure("Engine", engine_module.Engine, ENGINE_MODEL, 4, 8, 16)
pure("StaticBatchingEngine", engine_module.StaticBatchingEngine, ENGINE_MODEL, block_size=4,
     n_blocks=8)


def _engine(make=lambda: engine_module.Engine(ENGINE_MODEL, block_size=4, n_blocks=8,
                                             max_num_batched_tokens=16)):
    """An engine (an Engine by default) that has run one step of a request."""
    engine = make()
    engine.add_request([1, 2, 3, 4, 5], engine_module.SamplingParams(max_tokens=2))
    engine.step()
    return engine


def engine_state(engine):
    """An Engine's or a Gemma3Engine's: its queues, requests, pool, K and V (and peak)."""
    keys, values = engine._kv_arrays()
    return ([r.request_id for r in engine.waiting], [r.request_id for r in engine.running],
            {i: (list(r.all_token_ids), r.num_computed_tokens, list(r.block_table),
                 [list(table) for table in r.block_tables], r.status)
             for i, r in engine.requests.items()}, engine.step_count, pool_state(engine.pool),
            keys.copy(), values.copy(), getattr(engine, "peak_blocks", None))


CASES["Engine.add_request"] = lambda: (lambda engine: Case(
    engine.add_request, ([6, 7, 8], engine_module.SamplingParams(max_tokens=2)),
    state=lambda: engine_state(engine)))(_engine())
CASES["Engine.generate"] = lambda: (lambda engine: Case(
    engine.generate, ([[6, 7, 8]], engine_module.SamplingParams(max_tokens=2)),
    state=lambda: engine_state(engine)))(_engine())
CASES["Engine.abort_request"] = lambda: (lambda engine: Case(
    engine.abort_request, (0,), state=lambda: engine_state(engine)))(_engine())
CASES["Engine.output_of"] = lambda: (lambda engine: Case(
    engine.output_of, (0,), state=lambda: engine_state(engine)))(_engine())


@case("engine.summarize")
def _():
    engine = _engine()
    while engine.has_unfinished_requests():
        engine.step()
    return Case(engine_module.summarize, (engine, [0]))


POOL_KEYS = np.linspace(-1.0, 1.0, 3 * 2 * 4).reshape(3, 2, 4)       # 3 blocks of 2 rows, kv x dh 4
NEW_ROWS = np.linspace(0.5, -0.5, 8).reshape(2, 4)                   # T = 2 new rows
ATTENTION_ARGS = (np.linspace(-1.0, 1.0, 2 * 2 * 2).reshape(2, 2, 2), [3, 4], POOL_KEYS,
                  POOL_KEYS[::-1].copy(), [2, 0], 3, NEW_ROWS, NEW_ROWS[::-1].copy())
pure("block_attention", block_attention.block_attention, *ATTENTION_ARGS)
pure("gather_attention", block_attention.gather_attention, *ATTENTION_ARGS)
pure("attention_bytes", block_attention.attention_bytes, 10, 64, 2, True)
BATCHED_ARGS = (np.linspace(-1.0, 1.0, 2 * 2 * 1 * 2).reshape(2, 2, 1, 2), [[3], [1]], POOL_KEYS,
                POOL_KEYS[::-1].copy(), [[2, 0], [1, 1]])        # (R, h, T, dh), (R, T), tables
pure("batched_block_attention", block_attention.batched_block_attention, *BATCHED_ARGS)
pure("batched_gather_attention", block_attention.batched_gather_attention, *BATCHED_ARGS)

# ---- the engine serving Gemma 3 (local_and_global_layers) -----------------------------

from kvlib import gemma3 as gemma3_model  # noqa: E402
from kvlib.checkpoints.gemma3 import Gemma3Config  # noqa: E402
from kvlib.serving import gemma3_engine  # noqa: E402
from kvlib.serving import kv_cache_manager as groups_module  # noqa: E402

GEMMA3_TINY = gemma3_model.init_gemma3_params(Gemma3Config(
    vocab_size=12, hidden_size=4, intermediate_size=4, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=1, head_dim=2,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=3,
    max_position_embeddings=32, dtype="float64"), seed=22)
GROUPS = groups_module.kv_cache_groups(GEMMA3_TINY.config)

pure("Gemma3Engine", gemma3_engine.Gemma3Engine, GEMMA3_TINY, 2, 24, 8)
pure("kv_cache_groups", groups_module.kv_cache_groups, GEMMA3_TINY.config, True)
pure("skipped_tokens", groups_module.skipped_tokens, 7, 4)
pure("freeable_blocks", groups_module.freeable_blocks, 7, 4, 2)
pure("blocks_for_hit", groups_module.blocks_for_hit, 8, 4, 2)
pure("blocks_held", groups_module.blocks_held, GROUPS, 9, 2)
pure("block_bytes", groups_module.block_bytes, GEMMA3_TINY.config, 2, GROUPS)
pure("layers_per_group", groups_module.layers_per_group, GROUPS)
pure("blocks_in_memory", gemma3_engine.blocks_in_memory, GEMMA3_TINY.config, 4096, 2, True)
pure("pool_peak", gemma3_engine.pool_peak, GEMMA3_TINY.config,
     [(0, [1, 2, 3], engine_module.SamplingParams(max_tokens=2)),
      (1, [1, 2, 4, 5], engine_module.SamplingParams(max_tokens=3))], 2, False, 4, True)


for _name, _args in (("add_request", ([6, 7, 8], engine_module.SamplingParams(max_tokens=2))),
                     ("generate", ([[6, 7, 8]], engine_module.SamplingParams(max_tokens=2))),
                     ("abort_request", (0,)), ("output_of", (0,))):
    def _build(name=_name, args=_args):
        engine = _engine(lambda: gemma3_engine.Gemma3Engine(
            GEMMA3_TINY, block_size=2, n_blocks=24, max_num_batched_tokens=4))
        return Case(getattr(engine, name), args, state=lambda: engine_state(engine))
    CASES[f"Gemma3Engine.{_name}"] = _build


# ---- serving names the notebooks do not call ----------------------------------------------

SERVING_NOT_FUZZED = {
    **dict.fromkeys(["PrefixCache", "Scheduler", "SchedulerConfig", "block_key",
                     "paged_memory", "request_name", "batch_positions", "embed_batch",
                     "sequence_masks", "pad_left", "check_batch", "decode_each_alone",
                     "batched_decoder_block", "max_code", "quantization_step",
                     "check_speculation_length", "check_pair", "check_model", "certain",
                     "summarize", "Drafter", "ModelDrafter", "as_drafter"],
                    "serving's inside, called by kvlib (no notebook calls it): it trusts its "
                    "callers"),
    **dict.fromkeys(["Request", "requests_of_lengths"],
                    "requests that kvlib's workloads and engine build"),
    **dict.fromkeys(["Admission", "CachedBlock", "Checkpoint", "OnlineSoftmax", "PagedMemory",
                     "Proposal", "Quality", "RequestOutput", "Snapshot", "SpeculativeStats",
                     "SpeculativeStep", "Step", "StepRecord", "Timeline", "Verdict"],
                    "records and running state that kvlib's functions build"),
    **dict.fromkeys(["PerTokenStore", "PerChannelStore"],
                    "QuantizedKVCache's stores, called by it after its own checks"),
    "GreedyAcceptance": "takes no arguments",
    **dict.fromkeys(["forward_step", "write_rows", "batch_rows", "gemma3_forward_step"],
                    "the engine's step, called by Engine.step on requests it has checked"),
    **dict.fromkeys(["FullAttentionManager", "SlidingWindowManager", "KVCacheCoordinator",
                     "UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator", "coordinator_for",
                     "GroupedScheduler", "KVCacheTensors", "group_key", "checked_groups"],
                    "Gemma3Engine's accounting and storage, made and called by it on the "
                    "groups, pool and requests it has checked"),
    "KVCacheGroup": "a record that kv_cache_groups builds",
    "long_reply_workload": "local_and_global_layers's workload on Gemma 3's tokenizer (the "
                           "real file): its tests run it",
    **dict.fromkeys(["add_arrivals", "arrivals_in_seconds", "chat_prompts", "run_variant",
                     "variants", "workload", "workload_table"],
                    "the_engine's and batched_decoding's workloads on SmolLM2 (its tokenizer "
                    "and engines): their lessons' tests run them"),
}

# ---- the hybrid model and the local/global cache (state_layers) ---------------------------

from kvlib import deltanet as _deltanet  # noqa: E402
from kvlib import hybrid as _hybrid  # noqa: E402
from kvlib import hybrid_cache as _hybrid_cache  # noqa: E402
from kvlib.checkpoints.gemma3 import GEMMA3_270M as _GEMMA3  # noqa: E402
from kvlib.checkpoints.hybrid import load_hybrid as _load_hybrid  # noqa: E402
from kvlib.gemma3 import Gemma3Cache as _Gemma3Cache  # noqa: E402

HYBRID = _load_hybrid("stories-hybrid", "float64")
HYBRID_PROMPT = [0, 3, 7, 1, 9, 4, 4, 2]
RULE = dict(query=np.linspace(-1, 1, 6).reshape(3, 1, 2),
            key=np.linspace(1, -1, 6).reshape(3, 1, 2),
            value=np.linspace(-1, 1, 9).reshape(3, 1, 3), g=np.full((3, 1), -0.1),
            beta=np.full((3, 1), 0.5))


def hybrid_state(cache):
    """What a hybrid cache holds: its length, K and V rows, states and snapshots."""
    return (len(cache), cache_state(cache.kv),
            {layer: (cache.state(layer).conv.copy(), cache.state(layer).recurrent.copy())
             for layer in cache.config.deltanet_layers},
            cache.snapshot_positions)


def hybrid_prefilled(every=4):
    cache = _hybrid_cache.HybridCache(HYBRID.config, snapshot_every=every)
    _hybrid.hybrid_prefill(HYBRID, HYBRID_PROMPT, cache)
    return cache


def gemma_state(cache):
    return [tuple(np.array(x) for x in layer.held()) for layer in cache.layers]


pure("load_hybrid", _load_hybrid, "stories-hybrid", "float32")
pure("DeltaNetState.zeros", _deltanet.DeltaNetState.zeros, HYBRID.config)
pure("recurrent_gated_delta_rule", _deltanet.recurrent_gated_delta_rule, **RULE)
pure("chunked_gated_delta_rule", _deltanet.chunked_gated_delta_rule, **RULE, chunk_size=2)
pure("hybrid_forward", _hybrid.hybrid_forward, HYBRID, HYBRID_PROMPT)
pure("HybridCache", _hybrid_cache.HybridCache, HYBRID.config, 16, 4)
pure("common_prefix", _hybrid_cache.common_prefix, [1, 2, 3], [1, 2, 4])
pure("prefix_hits", _hybrid_cache.prefix_hits, [[1, 2, 3, 4], [1, 2, 3, 5]], 2)
pure("resumable_length", _hybrid_cache.resumable_length, 900, 1000, 528)
pure("generate_story", grammar.generate_story, np.random.default_rng(0))
pure("stories.load_tokenizer", kvlib.stories.load_tokenizer, "stories")
pure("Gemma3Cache", _Gemma3Cache, _GEMMA3, 8)


@case("hybrid_prefill")
def _():
    cache = hybrid_prefilled()
    return Case(_hybrid.hybrid_prefill, (HYBRID, [5, 6], cache),
                state=lambda: hybrid_state(cache))


@case("hybrid_decode_step")
def _():
    cache = hybrid_prefilled()
    return Case(_hybrid.hybrid_decode_step, (HYBRID, 5, cache), state=lambda: hybrid_state(cache))


def _hybrid_method(name, *args, prepare=None):
    def build():
        cache = hybrid_prefilled()
        if prepare is not None:
            args_now = prepare(cache)
        else:
            args_now = args
        return Case(getattr(cache, name), args_now, state=lambda: hybrid_state(cache))
    CASES[f"HybridCache.{name}"] = build


_WIDTH = HYBRID.config.n_kv_heads * HYBRID.config.head_dim
_hybrid_method("append", 3, np.full((1, _WIDTH), 0.5), np.full((1, _WIDTH), 0.5))
_hybrid_method("keys", 3)
_hybrid_method("values", 3)
_hybrid_method("state", 0)
_hybrid_method("truncate", 4)
_hybrid_method("snapshot")
_hybrid_method("checkpoint")
_hybrid_method("reset")


@case("HybridCache.restore")
def _():
    cache = hybrid_prefilled()
    saved = cache.checkpoint()
    _hybrid.hybrid_decode_step(HYBRID, 2, cache)
    return Case(cache.restore, (saved,), state=lambda: hybrid_state(cache))


def _gemma_method(name, *args):
    def build():
        cache = _Gemma3Cache(_GEMMA3, 8)
        rows = np.zeros((2, _GEMMA3.kv_width), dtype=np.float32)
        for index in range(_GEMMA3.num_hidden_layers):
            cache.update(index, rows, rows)
        return Case(getattr(cache, name), args, state=lambda: gemma_state(cache))
    CASES[f"Gemma3Cache.{name}"] = build


_gemma_method("update", 0, np.ones((1, _GEMMA3.kv_width), np.float32),
              np.ones((1, _GEMMA3.kv_width), np.float32))
_gemma_method("keys", 5)
_gemma_method("values", 5)
_gemma_method("key_positions", 5)

# ---- the evicting cache and the losses through any cache (keeping_what_attention_reads) --

from kvlib import long_context as _long_context  # noqa: E402


def evicting_state(cache):
    """What an evicting cache holds: its lengths, and each layer's positions, keys, values."""
    return (cache.lengths, [(cache.held_positions(i), np.array(cache.keys(i)),
                             np.array(cache.values(i))) for i in range(cache.config.n_layers)])


def _evicting_method(name, *args, budget=8):
    def build():
        cache = kvlib.EvictingCache(ROTARY.config, budget, "h2o")
        kvlib.prefill(ROTARY, PROMPT, cache)
        return Case(getattr(cache, name), args, state=lambda: evicting_state(cache))
    CASES[f"EvictingCache.{name}"] = build


pure("EvictingCache", kvlib.EvictingCache, ROTARY.config, 4, "tova")
pure("pyramid_budgets", kvlib.pyramid_budgets, 30, 128)
_evicting_method("held_positions", 1, budget=3)
_evicting_method("keys", 1, budget=3)
_evicting_method("values", 1, budget=3)
_evicting_method("key_positions", 2, budget=3)
_evicting_method("truncate", 2)
_evicting_method("reset")


@case("streaming_losses")
def _():
    cache = kvlib.EvictingCache(ROTARY.config, 3, "tova")
    return Case(_long_context.streaming_losses, (ROTARY, PROMPT, cache),
                state=lambda: evicting_state(cache))


@case("copied_tokens")
def _():
    cache = kvlib.EvictingCache(ROTARY.config, 3, "h2o")
    return Case(_long_context.copied_tokens, (ROTARY, [[0, 3], [7]], [1, 9], cache),
                state=lambda: evicting_state(cache))
