"""Exercises of the local_and_global_layers lesson (local and global layers): checkers and
solutions.

1. The bytes of Gemma 3 270M's cache after 8,192 tokens, in bfloat16.
2. Which of a sequence's blocks a sliding layer may give back (vLLM's rule).
3. Which layers of a 26-layer model with Gemma 3's rule are global.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from kvlib.checkpoints.gemma3 import GEMMA3_270M, gemma3_layer_types
from kvlib.memory import MiB, local_global_cache_bytes
from kvlib.serving.kv_cache_manager import freeable_blocks

from .base import (
    Feedback,
    as_number,
    checker,
    described,
    is_missing,
    near_miss,
    not_filled_in,
    read_whole_number,
    show_solution,
    shown,
)

EXERCISE1_TOKENS = 8_192
EXERCISE1_BYTES = 2                       # bfloat16
EXERCISE2 = {"sliding_window": 8, "block_size": 4, "num_computed_tokens": 27}
EXERCISE3_LAYERS = 26


def _bytes_with(layer_windows, n_kv_heads: int = 1, dtype_bytes: int = EXERCISE1_BYTES) -> int:
    return local_global_cache_bytes(layer_windows, EXERCISE1_TOKENS, n_kv_heads,
                                    GEMMA3_270M.head_dim, dtype_bytes=dtype_bytes)


@checker
def check_cache_bytes(answer) -> Feedback:
    """Exercise 1: bytes of Gemma 3 270M's cache (kvlib's Gemma3Cache: 512 rows in each
    sliding layer) after 8,192 tokens, K and V in bfloat16."""
    windows = GEMMA3_270M.layer_windows
    expected = _bytes_with(windows)
    if as_number(answer) in (expected / 1024, expected / MiB):
        return Feedback(False, "give the number of bytes, not KiB or MiB.")
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    every_layer = _bytes_with((None,) * len(windows))
    one_short = _bytes_with(tuple(None if w is None else w - 1 for w in windows))
    if value == expected:
        return Feedback(True, f"{expected:,} bytes ({expected / MiB:g} MiB): 3 x 8,192 + 15 x "
                        "512 positions of 1,024 bytes. Every layer global would be "
                        f"{every_layer / MiB:g} MiB.")
    if value == every_layer:
        return Feedback(False, "that is every layer keeping all 8,192 positions. The 15 "
                        "sliding layers keep only the last 512.")
    if value == 3 * EXERCISE1_TOKENS * 1024:
        return Feedback(False, "that counts the 3 global layers only: the 15 sliding layers "
                        "hold 512 positions each as well.")
    if value == 15 * 512 * 1024:
        return Feedback(False, "that counts the 15 sliding layers only: the 3 global layers "
                        "hold all 8,192 positions each as well.")
    if value == one_short:
        return Feedback(False, "that keeps 511 rows in each sliding layer, as transformers' "
                        "DynamicSlidingWindowLayer does between steps; the exercise counts "
                        "kvlib's Gemma3Cache, whose ring holds 512.")
    if value * 2 == expected:
        return Feedback(False, "half of it: the cache keeps K and V, both.")
    if value == expected * 2:
        return Feedback(False, "twice too much: bfloat16 is 2 bytes a number, not 4.")
    if value == expected * 4:
        return Feedback(False, "four times too much: Gemma 3 270M has 4 query heads but "
                        "only 1 K/V head, and only K/V heads are cached.")
    if value == expected * 8:
        return Feedback(False, "that counts bits: divide by 8 for bytes.")
    return near_miss(value, expected, "Count again: 2 x 1 K/V head x 256 x 2 bytes a "
                     "position and a layer.", "A position in one layer costs 2 (K and V) x "
                     "1 x 256 x 2 bytes; sum the positions each layer holds.")


def read_block_indices(answer, name: str = "answer") -> tuple[int, ...] | Feedback:
    """A collection of block indices (a list, tuple, set, range or 1-D array of whole
    numbers, in any order, possibly empty) -> sorted tuple of ints, or a Feedback."""
    if is_missing(answer):
        return not_filled_in(name, "a list of block indices, such as [0, 1]")
    if isinstance(answer, np.ndarray) and answer.ndim == 1 and answer.dtype.kind in "iuf":
        answer = answer.tolist()
    if isinstance(answer, (Integral, float)) and not isinstance(answer, bool):
        return Feedback(False, f"{name} should be a list of block indices, such as [0, 1], "
                        f"not one number ({shown(answer)}): list every block that may go.")
    if not isinstance(answer, (list, tuple, set, frozenset, range)):
        return Feedback(False, f"{name} should be a list of block indices, such as [0, 1]; "
                        f"got {described(answer)}.")
    indices = []
    for item in answer:
        value = read_whole_number(item, "a block index", f"each block index in {name}")
        if isinstance(value, Feedback):
            return value
        if value < 0:
            return Feedback(False, f"block indices start at 0, got {value}.")
        indices.append(value)
    if len(set(indices)) != len(indices):
        return Feedback(False, f"{name} names a block twice: {shown(sorted(indices))}.")
    return tuple(sorted(indices))


@checker
def check_blocks_to_free(answer) -> Feedback:
    """Exercise 2: the blocks a sliding layer (window 8, blocks of 4) may free once 27
    tokens are computed."""
    blocks = read_block_indices(answer)
    if isinstance(blocks, Feedback):
        return blocks
    e = EXERCISE2
    expected = tuple(freeable_blocks(e["num_computed_tokens"], e["sliding_window"],
                                     e["block_size"]))        # vLLM's rule, in kvlib
    if blocks == expected:
        return Feedback(True, "blocks 0 to 4 (positions 0-19). The next query, at position "
                        "27, reads positions 20 to 27; block 5 (20-23) stays.")
    if blocks == tuple(range(len(expected) - 1)):
        return Feedback(False, "block 4 holds positions 16-19, and the next query (position "
                        "27) reads 20 to 27 only: block 4 may go too.")
    if blocks == tuple(range(len(expected) + 1)):
        return Feedback(False, "block 5 holds positions 20-23, which the next query (at "
                        "position 27, window 8: 20 to 27) still reads.")
    if blocks == tuple(range(1, len(expected) + 1)):
        return Feedback(False, "count the blocks from 0: block 0 holds positions 0-3.")
    if blocks == tuple(range(1, len(expected))):
        return Feedback(False, "block 0 may go too: Gemma 3 keeps no attention sinks.")
    if not blocks:
        return Feedback(False, "some blocks may go: the next query reads only the last 8 "
                        "positions.")
    needed = {20 // e["block_size"], 27 // e["block_size"]}
    if needed & set(blocks):
        return Feedback(False, "a block holding positions 20 to 27 must stay: the next query "
                        "(position 27) reads them.")
    return Feedback(False, "not those. The next token sits at position 27 and reads the 8 "
                    "positions ending there; a block may go when every position in it is "
                    "older.")


def global_layers(n_layers: int) -> tuple[int, ...]:
    """The global layers of an n_layers model with Gemma 3's rule."""
    return tuple(i for i, kind in enumerate(gemma3_layer_types(n_layers))
                 if kind == "full_attention")


@checker
def check_global_layers(answer) -> Feedback:
    """Exercise 3: the global layers of a 26-layer model with Gemma 3's rule (layer l is
    global when (l + 1) % 6 == 0), counted from 0."""
    layers = read_block_indices(answer)
    if isinstance(layers, Feedback):
        return Feedback(False, layers.message.replace("block ind", "layer ind")
                        .replace("a block", "a layer").replace("Block ind", "Layer ind"))
    expected = global_layers(EXERCISE3_LAYERS)
    if layers == expected:
        return Feedback(True, "layers 5, 11, 17 and 23: four global layers, 22 sliding. The "
                        "last two layers (24, 25) slide.")
    if layers == tuple(i + 1 for i in expected):
        return Feedback(False, "those are counted from 1; count the layers from 0, as the "
                        "file and transformers do.")
    if layers == tuple(range(0, EXERCISE3_LAYERS, 6)):
        return Feedback(False, "that makes layer 0 global (l % 6 == 0). The rule is "
                        "(l + 1) % 6 == 0: the sixth layer, layer 5, is the first global one.")
    if layers == expected + (EXERCISE3_LAYERS - 1,):
        return Feedback(False, "the last layer is not global by itself: 25 + 1 = 26 is not a "
                        "multiple of 6.")
    if layers == global_layers(18):
        return Feedback(False, "those are Gemma 3 270M's (18 layers); with 26 layers the rule "
                        "gives one more.")
    if any(layer >= EXERCISE3_LAYERS for layer in layers):
        return Feedback(False, f"the model has layers 0 to {EXERCISE3_LAYERS - 1}.")
    return Feedback(False, "not those. Go through l = 0 .. 25 and keep the l with "
                    "(l + 1) % 6 == 0.")


SOLUTIONS = {
    1: """
config = kvlib.GEMMA3_270M
per_position = 2 * config.num_key_value_heads * config.head_dim * 2   # K and V, bfloat16
answer = (3 * 8192 + 15 * 512) * per_position
# or: kvlib.local_global_cache_bytes(config.layer_windows, 8192, 1, 256, dtype_bytes=2)
""",
    2: """
skipped = 27 - 8 + 1                  # positions 0 .. 19: no future query reads them
answer = list(range(skipped // 4))    # whole blocks among them: 0 to 4
""",
    3: """
answer = [layer for layer in range(26) if (layer + 1) % 6 == 0]
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
