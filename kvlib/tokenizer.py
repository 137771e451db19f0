"""A toy word-level tokenizer (embedding_lookup): 12 tokens, ids chosen to match the article."""

from __future__ import annotations

import re

from .checks import as_flag, as_instance, as_token_ids

BOS = "<bos>"

TOY_VOCABULARY = (BOS, "you", "am", "How", "fine", "I", "thanks", "are", ".", "?", "good", "and")
"""Token id -> word. "How are you?" is BOS 3 7 1 9, and 5 ("I") is the article's prediction."""

_WORD_OR_PUNCTUATION = re.compile(r"<bos>|\w+|[^\w\s]")


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
        if not isinstance(vocabulary, (list, tuple)) or not all(
                isinstance(word, str) and word for word in vocabulary):
            raise TypeError("the vocabulary must be a list of words (non-empty strings), got "
                            f"{vocabulary!r}")
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
        text, add_bos = as_instance("text", text, str), as_flag("add_bos", add_bos)
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
        ids = as_token_ids(ids, len(self.vocabulary), what="token ids", empty=True)
        return [self.vocabulary[i] for i in ids]

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
