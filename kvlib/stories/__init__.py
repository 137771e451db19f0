"""The stories corpus and the small trained models that ship with kvlib (notebook 12).

`grammar` generates seeded children's stories whose later sentences must repeat names and
things introduced early; `tokenizer` maps their words to ids. The trained models live in
kvlib/models/stories (the target) and kvlib/models/stories-draft (the draft).
"""

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
