"""GPT-2's tokenizer: byte-level BPE, written to be read (notebook 12).

Text becomes ids in four steps:
1. the pre-tokenizer pattern cuts the text into words, each with the space before it
   ("Hello, I am" -> "Hello", ",", " I", " am");
2. each word becomes its UTF-8 bytes, each byte shown as one printable character
   (`bytes_to_unicode`: the space is "Ġ", so " am" is written "Ġam");
3. byte-pair encoding (`bpe`) starts from those single characters and merges adjacent pairs,
   always the pair that ranks first among GPT-2's 50,000 learned merges, until no pair of
   the word is a merge ("Ġ a m" -> "Ġa m" -> "Ġam");
4. the vocabulary maps each resulting piece to its id (" am" -> 716).

Any text can be encoded, whatever its script or emoji: the 256 single bytes are all in the
vocabulary, so in the worst case a word stays a sequence of bytes. Decoding joins the pieces'
bytes and reads them as UTF-8.

The vocabulary and merges ship with kvlib (kvlib/gpt2/data/, OpenAI's files; see LICENSE
there). The same tokenizer is `GPT2Tokenizer` in transformers and the "gpt2" encoding in
tiktoken; tests/test_gpt2_tokenizer.py checks it against tiktoken.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import regex

DATA = Path(__file__).resolve().parent / "data"

PRETOKENIZER_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
"""GPT-2's: common English contractions; letters, digits or other symbols, each run with at
most one space in front; whitespace (a run before a word leaves its last space to the word)."""

END_OF_TEXT = "<|endoftext|>"
"""GPT-2's only special token, id 50256: it separates documents in training."""


def bytes_to_unicode() -> dict[int, str]:
    """Byte value (0-255) -> the printable character GPT-2 writes it as (notebook 12).

    The vocabulary files are text, and a byte such as the space or a newline would be hard to
    see in them, so each byte gets a visible stand-in. The 188 bytes that are printable
    characters of Latin-1 ("!" to "~", "¡" to "¬", "®" to "ÿ") stand for themselves; the other
    68 (controls, the space, ...) take the characters 256, 257, ... in byte order. So the
    space (32) is "Ġ" (256 + 32), the newline (10) is "Ċ" (256 + 10).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def read_vocabulary(path) -> dict[str, int]:
    """vocab.json (GPT-2's encoder.json): token, in bytes_to_unicode characters -> id."""
    path = Path(path)
    try:
        vocabulary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a JSON vocabulary ({error})") from None
    ids = list(vocabulary.values()) if isinstance(vocabulary, dict) else None
    if (ids is None or not all(type(i) is int for i in ids)
            or sorted(ids) != list(range(len(ids)))):
        raise ValueError(f"{path} must be a JSON object mapping each token to its id, the ids "
                         f"being 0, 1, ..., n - 1 once each")
    return vocabulary


def read_merges(path) -> list[tuple[str, str]]:
    """merges.txt (GPT-2's vocab.bpe): one merge a line, "Ġ t", highest priority first.

    The first line ("#version: 0.2") is a comment; blank lines are skipped.
    """
    path = Path(path)
    merges = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = tuple(line.split(" "))
        if len(pair) != 2 or not all(pair):
            raise ValueError(f"{path}, line {number}: {line!r} is not a merge of two pieces "
                             "separated by one space")
        merges.append(pair)
    return merges


class Tokenizer:
    """GPT-2's byte-level BPE tokenizer (notebook 12).

    >>> tokenizer = Tokenizer.gpt2()
    >>> tokenizer.encode("Hello, I am")
    [15496, 11, 314, 716]
    >>> tokenizer.tokens([15496, 11, 314, 716])
    ['Hello', ',', ' I', ' am']
    >>> tokenizer.decode([15496, 11, 314, 716])
    'Hello, I am'

    vocabulary: token (in bytes_to_unicode characters, "Ġam") -> id; merges: pairs of pieces,
    highest priority first. The text "<|endoftext|>" inside encode's input becomes the special
    token (id 50256), as in transformers' GPT2Tokenizer (tiktoken's encode refuses it unless
    allowed_special says otherwise); encode_ordinary reads it as plain text instead.
    """

    def __init__(self, vocabulary: dict[str, int], merges: list[tuple[str, str]]):
        self.vocabulary = dict(vocabulary)
        self.merge_ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
        self.byte_to_char = bytes_to_unicode()
        self.char_to_byte = {char: byte for byte, char in self.byte_to_char.items()}
        self._check_consistency()
        self.token_bytes = [b""] * len(self.vocabulary)
        for token, token_id in self.vocabulary.items():
            self.token_bytes[token_id] = bytes(self.char_to_byte[char] for char in token)
        self.eot_id = self.vocabulary[END_OF_TEXT]
        self._bpe_cache: dict[str, tuple[str, ...]] = {}

    def _check_consistency(self) -> None:
        if sorted(self.vocabulary.values()) != list(range(len(self.vocabulary))):
            raise ValueError("the vocabulary's ids must be 0, 1, ..., n - 1, each once")
        missing_bytes = set(self.byte_to_char.values()) - self.vocabulary.keys()
        if missing_bytes:
            raise ValueError(f"the vocabulary lacks the single-byte tokens "
                             f"{sorted(missing_bytes)[:5]}: it cannot encode every text")
        if END_OF_TEXT not in self.vocabulary:
            raise ValueError(f"the vocabulary has no {END_OF_TEXT!r} token")
        for left, right in self.merge_ranks:
            if left + right not in self.vocabulary:
                raise ValueError(f"the merge {left!r} + {right!r} gives {left + right!r}, "
                                 "which is not in the vocabulary")
        foreign = [token for token in self.vocabulary if token != END_OF_TEXT
                   and not set(token) <= self.char_to_byte.keys()]
        if foreign:
            raise ValueError(f"vocabulary tokens {foreign[:5]} use characters that stand for "
                             "no byte (see bytes_to_unicode)")

    @classmethod
    def from_files(cls, vocabulary_path, merges_path) -> Tokenizer:
        """From a vocabulary (vocab.json / encoder.json) and merges (merges.txt / vocab.bpe)."""
        return cls(read_vocabulary(vocabulary_path), read_merges(merges_path))

    @classmethod
    def from_directory(cls, directory) -> Tokenizer:
        """From a folder in the model hub's layout: vocab.json and merges.txt."""
        directory = Path(directory)
        missing = [name for name in ("vocab.json", "merges.txt")
                   if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} has no {' and no '.join(missing)}: a GPT-2 "
                                    "tokenizer in the model hub's layout needs both")
        return cls.from_files(directory / "vocab.json", directory / "merges.txt")

    @staticmethod
    def gpt2() -> Tokenizer:
        """GPT-2's tokenizer from the files shipped with kvlib (built once, then shared)."""
        return load_tokenizer()

    def __len__(self) -> int:
        return len(self.vocabulary)

    def __repr__(self) -> str:
        return f"Tokenizer({len(self):,} tokens, {len(self.merge_ranks):,} merges)"

    def bpe(self, word: str) -> tuple[str, ...]:
        """One pre-token, in bytes_to_unicode characters -> its BPE pieces ("Ġam" -> ("Ġam",)).

        Start from single characters; repeatedly merge every occurrence (left to right) of the
        adjacent pair whose merge ranks first, until no adjacent pair is a merge.
        """
        if word in self._bpe_cache:
            return self._bpe_cache[word]
        pieces = list(word)
        while len(pieces) > 1:
            pairs = zip(pieces, pieces[1:])
            best = min(pairs, key=lambda pair: self.merge_ranks.get(pair, float("inf")))
            if best not in self.merge_ranks:
                break
            pieces = merge_pair(pieces, best)
        if len(self._bpe_cache) >= 100_000:  # bounded: arbitrary text has no end of words
            self._bpe_cache.clear()
        self._bpe_cache[word] = tuple(pieces)
        return self._bpe_cache[word]

    def encode(self, text: str) -> list[int]:
        """Text -> ids; "<|endoftext|>" in the text becomes the special token 50256."""
        _check_text(text)
        ids = []
        for number, part in enumerate(text.split(END_OF_TEXT)):
            if number > 0:
                ids.append(self.eot_id)
            ids.extend(self._encode_words(part))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, with no special tokens: "<|endoftext|>" is encoded as plain text."""
        _check_text(text)
        return self._encode_words(text)

    def _encode_words(self, text: str) -> list[int]:
        """Steps 1-4 of the module's docstring, on text already checked."""
        ids = []
        for word in PRETOKENIZER_PATTERN.findall(text):
            characters = "".join(self.byte_to_char[byte] for byte in word.encode("utf-8"))
            ids.extend(self.vocabulary[piece] for piece in self.bpe(characters))
        return ids

    def decode(self, ids) -> str:
        """Ids -> text; a character whose UTF-8 bytes the ids leave incomplete shows as U+FFFD."""
        return b"".join(self.token_bytes[i] for i in self._check_ids(ids)).decode(
            "utf-8", errors="replace")

    def tokens(self, ids) -> list[str]:
        """Ids -> each token's own text, for labels: [" am", ...] (the space kept, not "Ġ").

        A token holding only part of a character's UTF-8 bytes shows them as escapes ("\\xf0").
        """
        return [self.token_bytes[i].decode("utf-8", errors="backslashreplace")
                for i in self._check_ids(ids)]

    def _check_ids(self, ids) -> list[int]:
        """A sequence of ids (or one id) -> list[int], each in 0 .. len(self) - 1."""
        if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
            ids = [ids]
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise TypeError(f"ids must be a 1-d array of integers, got an array of "
                                f"shape {ids.shape} and dtype {ids.dtype}")
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ids must be a sequence of integers, got {type(ids).__name__} "
                            f"{ids!r}")
        ids = list(ids)
        not_integers = [i for i in ids
                        if isinstance(i, bool) or not isinstance(i, (int, np.integer))]
        if not_integers:
            raise TypeError(f"ids must be integers, got {not_integers[:5]!r}")
        outside = [int(i) for i in ids if not 0 <= i < len(self)]
        if outside:
            raise ValueError(f"ids {outside[:5]} are outside the vocabulary: valid ids are "
                             f"0 to {len(self) - 1}")
        return [int(i) for i in ids]


def merge_pair(pieces: list[str], pair: tuple[str, str]) -> list[str]:
    """Every occurrence of the adjacent pair, left to right, becomes one piece."""
    merged, i = [], 0
    while i < len(pieces):
        if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == pair:
            merged.append(pieces[i] + pieces[i + 1])
            i += 2
        else:
            merged.append(pieces[i])
            i += 1
    return merged


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise TypeError(f"encode expects a str, got {type(text).__name__}"
                        + (": decode the bytes first" if isinstance(text, bytes) else ""))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the text holds {text[error.start]!r} at position {error.start}, a "
                         "lone surrogate, which is no character and has no UTF-8 bytes") from None


@lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    """GPT-2's tokenizer from kvlib/gpt2/data/ (encoder.json, vocab.bpe); built once."""
    return Tokenizer.from_files(DATA / "encoder.json", DATA / "vocab.bpe")
