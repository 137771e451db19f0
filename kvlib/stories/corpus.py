"""The training and held-out sequences of the stories models (what_the_heads_read), numpy only:
the training script and the tests build the very same sequences from a seed.

A sequence is CONTEXT_LENGTH tokens of whole stories one after another, each starting with
BOS; the story that does not fit is cut at the end of the sequence, and the next sequence
starts with a fresh story. So every sequence starts with BOS at position 0, and a window
lesson can measure the loss at positions far beyond a window of 32 or 64.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from ..checks import as_whole_number
from .grammar import MAX_STORIES, generate_story
from .tokenizer import StoryTokenizer

CONTEXT_LENGTH = 256
TRAINING_SEED = 2024
"""Seed of the training stories (tools/train_stories.py)."""
HELD_OUT_SEED = 7
"""Seed of the held-out stories, on which the models are measured and tested."""


def pack(stories: Iterable[list[int]], length: int = CONTEXT_LENGTH,
         n_sequences: int | None = None) -> np.ndarray:
    """Stories' ids (each starting with BOS) -> sequences (n, length), int64.

    Stories are laid one after another; a sequence ends where it is full (the last story is
    cut there) and the next one starts with the next story. Stops after n_sequences (needed
    when stories is an endless generator); a last sequence that is not full is dropped.
    """
    if length < 2:
        raise ValueError(f"a sequence needs at least 2 tokens, got length {length}")
    sequences, current = [], []
    for story in stories:
        if n_sequences is not None and len(sequences) == n_sequences:
            break
        current += list(story)
        if len(current) >= length:
            sequences.append(current[:length])
            current = []
    return np.array(sequences, dtype=np.int64).reshape(-1, length)


def story_sequences(n_sequences: int, seed: int, length: int = CONTEXT_LENGTH) -> np.ndarray:
    """n_sequences packed sequences of stories from one seeded generator: (n, length)."""
    n_sequences = as_whole_number("n_sequences", n_sequences, 0, MAX_STORIES)
    length = as_whole_number("length", length, 2, 2**16)
    rng = np.random.default_rng(as_whole_number("seed", seed))
    tokenizer = StoryTokenizer()
    stories = (tokenizer.encode(generate_story(rng)) for _ in itertools.count())
    return pack(stories, length, n_sequences)
