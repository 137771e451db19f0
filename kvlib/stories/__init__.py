"""The stories corpus and the small trained models that ship with kvlib (real_model).

`grammar` generates seeded children's stories whose later sentences must repeat names and
things introduced early; `tokenizer` maps their words to ids. The trained models live in
kvlib/models/stories (the target) and kvlib/models/stories-draft (the draft); load_model
reads either, in the dtype asked for.
"""

from pathlib import Path

from .grammar import (
    Repeat,
    first_error,
    forced_repeats,
    generate_stories,
    generate_story,
    is_grammatical,
    slot_of_each_word,
    text_to_words,
    words_to_text,
)
from .tokenizer import StoryTokenizer

MODELS = ("stories", "stories-draft")
"""The trained story models that ship with kvlib (kvlib/models/README.md)."""


def model_directory(name: str = "stories") -> Path:
    """The folder of a shipped story model: kvlib/models/<name>."""
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"name must be one of the shipped story models {MODELS}, got {name!r}")
    return Path(__file__).resolve().parent.parent / "models" / name


def load_model(name: str = "stories", dtype: str = "float32"):
    """A shipped story model's weights (kvlib.Params) in float32 or float64, read by
    kvlib.gpt2.load exactly as GPT-2 124M is (the models are GPT-2's architecture)."""
    from kvlib import gpt2

    return gpt2.load(model_directory(name), dtype)


def load_tokenizer(name: str = "stories") -> StoryTokenizer:
    """The word-level tokenizer of a shipped story model (both share one vocabulary)."""
    return StoryTokenizer.from_directory(model_directory(name))

