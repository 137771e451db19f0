"""A toy word-level tokenizer (embedding_lookup): 12 tokens, ids chosen to match the article."""

from __future__ import annotations

import re

import numpy as np

from .checks import contains_bool

BOS = "<bos>"

TOY_VOCABULARY = (BOS, "you", "am", "How", "fine", "I", "thanks", "are", ".", "?", "good", "and")
"""Token id -> word. "How are you?" is BOS 3 7 1 9, and 5 ("I") is the article's prediction."""

_WORD_OR_PUNCTUATION = re.compile(r"<bos>|\w+|[^\w\s]")


def _iterable(value):
    try:
        return list(value)
    except TypeError:
        return [None]


class ToyTokenizer:
    """Splits text into words and punctuation and maps each to its id.

    >>> tokenizer = ToyTokenizer()
    >>> tokenizer.encode("How are you?")
    [0, 3, 7, 1, 9]
    >>> tokenizer.decode([0, 3, 7, 1, 9, 5, 2, 4])
    'How are you? I am fine'

    Matching ignores case; decoding gives each word as it is written in the vocabulary.
    """

    def __init__(self, vocabulary: tuple[str, ...] = TOY_VOCABULARY):
        if isinstance(vocabulary, (str, bytes)) or not all(
                isinstance(word, str) and word for word in _iterable(vocabulary)):
            raise TypeError("the vocabulary must be a sequence of words (non-empty strings), "
                            f"got {vocabulary!r}")
        self.vocabulary = tuple(vocabulary)
        lowered = [word.lower() for word in self.vocabulary]
        repeated = sorted({w for w in lowered if lowered.count(w) > 1})
        if repeated:
            raise ValueError(f"the vocabulary lists {repeated} more than once (matching ignores "
                             "case, so 'A' and 'a' are the same word): each word needs one id")
        if BOS not in self.vocabulary:
            raise ValueError(f"the vocabulary must contain the beginning token {BOS!r}")
        self._ids = {word: index for index, word in enumerate(lowered)}
        self.bos_id = self._ids[BOS]

    def __len__(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Text -> ids, with the BOS id in front unless add_bos is False."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a string, got {type(text).__name__}")
        if not isinstance(add_bos, (bool, np.bool_)):
            raise TypeError(f"add_bos must be True or False, got {add_bos!r}")
        words = _WORD_OR_PUNCTUATION.findall(text)
        unknown = [word for word in words if word.lower() not in self._ids]
        if unknown:
            raise ValueError(
                f"unknown word(s) {unknown}: this toy vocabulary only has {self.words()}"
            )
        ids = [self._ids[word.lower()] for word in words]
        return [self.bos_id, *ids] if add_bos else ids

    def tokens(self, ids) -> list[str]:
        """Ids -> the token strings, BOS included (for labelling plots)."""
        return [self.vocabulary[i] for i in self._check_ids(ids)]

    def decode(self, ids) -> str:
        """Ids -> text; BOS is left out and punctuation is attached to the word before it."""
        text = ""
        for token in self.tokens(ids):
            if token == BOS:
                continue
            separator = "" if not text or re.fullmatch(r"[^\w\s]", token) else " "
            text += separator + token
        return text

    def words(self) -> list[str]:
        return [word for word in self.vocabulary if word != BOS]

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, (str, bytes, dict, set)) or contains_bool(ids):
            raise TypeError(f"ids must be a sequence of integers, got {ids!r}")
        try:
            ids = np.atleast_1d(np.asarray(ids))
        except ValueError:
            raise TypeError(f"ids must be a flat sequence of integers, got {ids!r}") from None
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise TypeError(f"ids must be a sequence of integers, got {ids.tolist()!r}")
        bad = [int(i) for i in ids if not 0 <= i < len(self.vocabulary)]
        if bad:
            raise ValueError(
                f"id(s) {bad} are outside the vocabulary: valid ids are 0 to "
                f"{len(self.vocabulary) - 1} ({dict(enumerate(self.vocabulary))})"
            )
        return [int(i) for i in ids]
