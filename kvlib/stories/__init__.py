"""The stories corpus and the small trained models that ship with kvlib (notebook 11).

`grammar` generates seeded children's stories whose later sentences must repeat names and
things introduced early; `tokenizer` maps their words to ids. The trained models live in
kvlib/models/stories (the target) and kvlib/models/stories-draft (the draft).
"""

from .grammar import (
    NameRepeat,
    first_error,
    generate_stories,
    generate_story,
    is_grammatical,
    repeated_names,
    slot_of_each_word,
    text_to_words,
    words_to_text,
)
from .tokenizer import StoryTokenizer
