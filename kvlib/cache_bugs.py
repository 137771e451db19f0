"""A zoo of real KV-cache bugs, each planted in a small decode loop (when_the_cache_is_wrong).

Every bug here was reported in a public repository (BUGS names the thread). Each is planted in
`decode_step` or `prefill` below, the loop of the kv_cached_decode lesson written out with kvlib's
building blocks, so that kvlib.debug.first_divergence can watch it; the lesson runs the locator on
each and reads what it says.

    decode_step(params, token_id, cache) -> logits (1, V)      the right loop
    prefill(params, ids, cache) -> (logits, cache)               the right prompt pass
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import model
from .inference import forward
from .params import Params
from .positions import add_positions, rotary_positions

# ------------------------------------------------------------------------------ the right loop

def run_blocks(params: Params, ids, positions, cache, mask, rotary) -> np.ndarray:
    """The stack of blocks over a chunk of ids at `positions`, appending to cache -> the last
    row's logits (1, V). One place for what every loop below shares."""
    config = params.config
    X = model.embed(np.asarray(ids), params.embedding)
    if config.positions == "learned":
        X = add_positions(X, params.position_table, positions)
    for index, layer in enumerate(params.layers):
        X = model.decoder_block(X, layer, config.n_heads, mask=mask, cache=cache,
                                layer_index=index, rotary=rotary,
                                norm_epsilon=config.norm_epsilon)
    X = model.normalize(X[-1:], params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return model.unembed(X, params.embedding)


def _mask(params: Params, positions, cache) -> np.ndarray | None:
    config = params.config
    mask = model.attention_mask(positions, cache.key_positions(len(positions)), config.window,
                                config.sink_tokens)
    return None if mask.all() else mask


def decode_step(params: Params, token_id: int, cache) -> np.ndarray:
    """The right decode step (kv_cached_decode): the token at position len(cache)."""
    positions = np.array([len(cache)])
    return run_blocks(params, [token_id], positions, cache, _mask(params, positions, cache),
                      rotary_positions(params.config, positions))


def prefill(params: Params, ids, cache):
    """The right prompt pass (prefill): positions 0 .. T-1, the causal mask."""
    positions = np.arange(len(cache), len(cache) + len(ids))
    logits = run_blocks(params, ids, positions, cache, _mask(params, positions, cache),
                        rotary_positions(params.config, positions))
    return logits, cache


# ------------------------------------------------------------------------------ the bugs

class JumpingOffset:
    """tiny-llm PR #46: the offset that places the new token grows by the length of the chunk
    that was fed, and the prompt's length is added once more after the first decode step: a
    6-token prompt puts the first new token at 6 (right), the second at 12, then 13, 14, ..."""

    def __init__(self):
        self.offset = None
        self.jump = None

    def __call__(self, params, token_id, cache):
        if self.offset is None:
            self.offset = self.jump = len(cache)
        positions = np.array([self.offset])
        logits = run_blocks(params, [token_id], positions, cache,
                            _mask(params, positions, cache),
                            rotary_positions(params.config, positions))
        self.offset += self.jump           # the bug: the prompt's length, not the new token's 1
        self.jump = 1
        return logits


def prefill_without_mask(params, ids, cache):
    """Mikyx-1/TinyLLM #17: the mask was applied only `if cache is None`, so the prompt's
    pass, which runs with a cache attached, ran without it: every prompt position read the
    positions after it, and that went into the cached K and V."""
    positions = np.arange(len(cache), len(cache) + len(ids))
    return run_blocks(params, ids, positions, cache, None,
                      rotary_positions(params.config, positions)), cache


def decode_step_mask_from_the_top(params, token_id, cache):
    """PyTorch #144858: a causal mask built for T queries and S keys from the top-left corner
    (what is_causal=True gives in scaled_dot_product_attention): with one query against the
    cache, it sees only the first key."""
    positions = np.array([len(cache)])
    S = len(cache) + 1
    mask = np.tri(1, S, dtype=bool)       # the bug: should be aligned to the end, k=S-1
    return run_blocks(params, [token_id], positions, cache, mask,
                      rotary_positions(params.config, positions))


class SharedBatchPosition:
    """unslothai/unsloth #3699: a left-padded batch decoded with one
    position for every row, the padded length; a shorter prompt's tokens sit `padding`
    positions too far."""

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, params, token_id, cache):
        positions = np.array([len(cache) + self.padding])     # the bug: one batch position
        return run_blocks(params, [token_id], positions, cache,
                          _mask(params, positions - self.padding, cache),
                          rotary_positions(params.config, positions))


def decode_step_window_one_short(params, token_id, cache):
    """A sliding window one short: the new key and W - 2 earlier ones, W - 1 keys where the
    model was trained on W. The mirror image of mlx-lm PR #390 ("fix window attention mask"),
    whose mask let a query see one key too many (129 where Gemma 3 and gpt-oss see 128); the
    locator finds either the same way. Needs a window config."""
    window = params.config.window
    positions = np.array([len(cache)])
    keys = cache.key_positions(1)
    mask = model.attention_mask(positions, keys, window - 1, params.config.sink_tokens)
    return run_blocks(params, [token_id], positions, cache, mask,
                      rotary_positions(params.config, positions))


class PrefixCacheWithoutParent:
    """vLLM RFC #2614: blocks of a prefix cache keyed by their own tokens only, not by their
    parent: a block whose tokens match another sequence's block at the same place is reused,
    although everything before it differs. `others` are earlier requests' prompts, whose
    blocks the cache keeps."""

    def __init__(self, params: Params, block_size: int, others):
        self.block_size, self.blocks = block_size, {}
        for ids in others:
            ids = list(ids)
            _, cache = prefill(params, ids, _fresh(params))
            for start in range(0, len(ids) - block_size + 1, block_size):
                key = (start, tuple(ids[start:start + block_size]))   # the bug: no parent
                self.blocks.setdefault(key, [
                    (cache.keys(l)[start:start + block_size].copy(),
                     cache.values(l)[start:start + block_size].copy())
                    for l in range(params.config.n_layers)])

    def __call__(self, params, ids, cache):
        ids, start = list(ids), 0
        while start + self.block_size < len(ids):      # the last token always runs
            key = (start, tuple(ids[start:start + self.block_size]))
            if key in self.blocks:
                for layer, (k, v) in enumerate(self.blocks[key]):
                    cache.append(layer, k, v)
            else:
                prefill(params, ids[start:start + self.block_size], cache)
            start += self.block_size
        return prefill(params, ids[start:], cache)


def _fresh(params):
    from .cache import make_cache

    return make_cache(params.config)


class RolledBack:
    """lablup/mlxcel #994 ("draft KV cache rewind trims two entries too many"; PR #1002 trims
    rejected - 1 instead of rejected + 1): after every step a speculative guess is rejected and
    its row rolled back, by `by` positions: 1 is right; 2 is one too far (the step's own row is
    lost), 0 one too short (the rejected row stays). mlxcel's bug was in the draft model's
    cache, where it only starved the drafter; planted in the cache that produces the output, it
    changes it."""

    def __init__(self, by: int):
        self.by = by

    def __call__(self, params, token_id, cache):
        logits = decode_step(params, token_id, cache)
        decode_step(params, int(np.argmax(logits[-1])), cache)      # a draft's guess
        cache.truncate(len(cache) - self.by)
        return logits


class CacheNeverRead:
    """rasbt/LLMs-from-scratch PR #981: the Qwen3.5 KV-cache notebook's streaming generate loop
    called the model on the whole sequence at every step and never handed it the cache: the
    answers were right and nothing was faster (9.00 tokens/s, as without a cache; 15.16 after
    the fix, by the PR's own figures). Planted here a little worse: the cache is filled at
    every step, and still never read."""

    def __init__(self, prompt):
        self.ids = list(prompt)

    def __call__(self, params, token_id, cache):
        self.ids.append(int(token_id))
        decode_step(params, token_id, cache)                       # filled, never read
        return forward(params, self.ids, last_only=True)


class RotaryTableForPrompt:
    """karpathy/nanochat PR #520: the rotary table's length was checked against the new tokens T
    instead of T0 + T; here a table precomputed for `length` positions, sliced at the new
    token's position: past its end the slice is empty and the step fails."""

    def __init__(self, length: int):
        self.length = length
        self.table = None

    def __call__(self, params, token_id, cache):
        config = params.config
        if self.table is None:
            self.table = rotary_positions(config, np.arange(self.length)).angles
        position = len(cache)
        positions = np.array([position])
        rotation = rotary_positions(config, positions)
        # the bug: the angles are sliced from the table, which ends at self.length
        object.__setattr__(rotation, "angles", self.table[position:position + 1])
        return run_blocks(params, [token_id], positions, cache,
                          _mask(params, positions, cache), rotation)


@dataclass(frozen=True)
class Bug:
    """One bug of the zoo: its name, the public thread that reported it, the symptom users saw,
    and the fix."""

    name: str
    source: str
    symptom: str
    fix: str


BUGS = {
    "offset": Bug("an offset that jumps after the first decode step", "skyzh/tiny-llm PR #46",
                  "the first new token is right, then the text turns to garbage",
                  "set the offset to len(cache) before each step; never add to it"),
    "mask": Bug("no causal mask in a multi-token prefill", "Mikyx-1/TinyLLM #17",
                "generate() wrote garbage within a token or two although the training loss was "
                "low and teacher-forced passes predicted every token: training never passes "
                "a cache, so it never took the branch that skipped the mask",
                "pass the causal mask (aligned to the end) whenever more than one query runs"),
    "top-left": Bug("a causal mask aligned to the top-left with one query",
                    "pytorch/pytorch #144858 (is_causal in scaled_dot_product_attention)",
                    "decoding with the cache gives other tokens than without it",
                    "align the mask to the end (queries are the last positions), or pass no "
                    "mask for one query"),
    "batch": Bug("one position for a whole left-padded batch",
                 "unslothai/unsloth #3699",
                 "batched generation is worse than one prompt at a time for the short prompts",
                 "give each row its own position: the count of its real tokens"),
    "window": Bug("a sliding window off by one", "ml-explore/mlx-lm PR #390",
                  "long generations drift slightly from the reference after W tokens",
                  "keep W positions, the new one included: W - 1 earlier keys"),
    "parent": Bug("a prefix-cache key without its parent", "vllm-project/vllm RFC #2614",
                  "a request gives a wrong answer only when another request ran before it",
                  "key each block by its parent's key and its tokens, so a key stands for the "
                  "whole prefix"),
    "rollback": Bug("a draft cache rolled back too far or too short", "lablup/mlxcel #994",
                    "mlxcel's draft model lost two rows too many and guessed worse (the output "
                    "stays right, the speed-up shrinks); in the target's cache, as planted "
                    "here, the output itself changes",
                    "truncate to exactly the accepted length: len(cache) - rejected"),
    "never read": Bug("a cache that is filled but never read",
                      "rasbt/LLMs-from-scratch PR #981",
                      "right answers and no speed-up: 9.00 tokens/s with the cache, as without "
                      "one (15.16 after the fix)",
                      "feed only the new token, and pass the cache so that it attends over it"),
    "rotary table": Bug("a rotary table sized for T instead of T0 + T",
                        "karpathy/nanochat PR #520",
                        "generation fails (or goes wrong) once the sequence outgrows the table",
                        "size and check the table for T0 + T, the cached positions included"),
}


__all__ = ["BUGS", "Bug", "CacheNeverRead", "JumpingOffset", "PrefixCacheWithoutParent",
           "RolledBack", "RotaryTableForPrompt", "SharedBatchPosition", "decode_step",
           "decode_step_mask_from_the_top", "decode_step_window_one_short", "prefill",
           "prefill_without_mask", "run_blocks"]


# ------------------------------------------------------------------ the zoo on the story model

ZOO_PROMPT = ("Long ago, in a small village, there lived a funny girl named Mia. Mia had a "
              "big bell. Mia had a friend named Tom.")
"""The prompt every bug of the zoo runs on (the lesson's exercises 1 and 2 too)."""

ZOO_FORMATS = ("float32", "float16", "bfloat16")
"""The number formats the zoo's bugs run in (kvlib.precision's emulation in 16 bits)."""


def zoo_tolerance(number_format: str) -> float | None:
    """The locator's tolerance for the story model in a format of the zoo
    (when_the_cache_is_wrong): its default in float32 (None), in 16 bits the one
    tools/measure_tolerances.py measured (kvlib.debug.tolerance_for)."""
    from . import debug  # above this module: imported when a tolerance is asked for

    return None if number_format == "float32" else debug.tolerance_for(number_format, "stories")


ZOO_WINDOW = 24
ZOO_OTHER_PROMPT = ("Long ago, in a small village, there lived a funny boy named Sam. Mia had a "
                    "big bell. Mia had a friend named Tom.")


def zoo(tokenizer, prompt: list[int]) -> dict:
    """The bugs the widget can plant in the story model: label -> (config changes, a function
    that makes (decode_step, prefill) afresh; stateful bugs need a new one each run)."""
    other = tokenizer.encode(ZOO_OTHER_PROMPT)
    right = (decode_step, prefill)
    return {
        "none: the right loop": ({}, lambda params: right),
        "1 offset that jumps": ({}, lambda params: (JumpingOffset(), prefill)),
        "2 no mask in the prefill": ({}, lambda params: (decode_step,
                                                         prefill_without_mask)),
        "3 mask from the top-left": ({}, lambda params: (decode_step_mask_from_the_top,
                                                         prefill)),
        "4 one batch position": ({}, lambda params: (SharedBatchPosition(6), prefill)),
        "5 window one short": ({"window": ZOO_WINDOW}, lambda params: (
            decode_step_window_one_short, prefill)),
        "5 window, the right loop": ({"window": ZOO_WINDOW}, lambda params: right),
        "6 prefix key without parent": ({}, lambda params: (
            decode_step, PrefixCacheWithoutParent(params, 4, [other]))),
        "7 rollback one too far": ({}, lambda params: (RolledBack(2), prefill)),
        "7 rollback one too short": ({}, lambda params: (RolledBack(0), prefill)),
        "8 cache never read": ({}, lambda params: (CacheNeverRead(prompt), prefill)),
    }


def run_bug(story, tokenizer, prompt, label: str, number_format: str, n_new_tokens: int = 16):
    """One bug of the zoo in one format -> (differences (n_new_tokens,), the locator's report or
    None (with zoo_tolerance(number_format)), the rows each of the n_new_tokens - 1 decode steps
    computed)."""
    from . import debug, precision  # above this module: imported when a bug is run

    changes, make = zoo(tokenizer, prompt)[label]
    params = precision.in_format(story, number_format)
    params = params.with_config(**changes) if changes else params
    with precision.computed_in(number_format):
        step, first_pass = make(params)
        differences = debug.logit_differences(params, prompt, n_new_tokens, step,
                                              prefill=first_pass)
        step, first_pass = make(params)      # stateful bugs start afresh for every run
        found = debug.first_divergence(params, prompt, n_new_tokens, step, prefill=first_pass,
                                       tolerance=zoo_tolerance(number_format))
        step, _ = make(params)
        rows = debug.rows_computed(params, prompt, n_new_tokens, step)
    return differences, found, rows
