"""Byte-level BPE, the tokenizer of GPT-2 and of SmolLM2 (what_the_heads_read and model_of_today),
written to be read.

Text becomes ids in four steps:
1. the pre-tokenizer cuts the text into words, each with the space before it
   ("Hello, I am" -> "Hello", ",", " I", " am"); SmolLM2's first cuts every digit apart
   ("2024" -> "2", "0", "2", "4"), then applies GPT-2's pattern to what is left;
2. each word becomes its UTF-8 bytes, each byte shown as one printable character
   (`bytes_to_unicode`: the space is "Ġ", so " am" is written "Ġam");
3. byte-pair encoding (`bpe`) starts from those single characters and merges adjacent pairs,
   always the pair that ranks first among the learned merges, until no pair of the word is
   a merge ("Ġ a m" -> "Ġa m" -> "Ġam");
4. the vocabulary maps each resulting piece to its id (" am" -> 716 for GPT-2).

Special tokens ("<|endoftext|>", SmolLM2's "<|im_start|>") are found in the text before
step 1 and become their ids directly; they are never cut into pieces. Text that people typed
should not be read that way (it could forge a chat turn): `encode_ordinary` reads special
tokens as plain text, and `apply_chat_template` only parses the template's own markers
(kvlib.chat explains how).

Any text can be encoded, whatever its script or emoji: GPT-2's vocabulary holds all 256
single bytes, so in the worst case a word stays a sequence of bytes. SmolLM2's lacks 21 bytes
that text almost never contains (controls such as 0x04, and 0xC0, 0xC1, 0xF1, 0xF2, 0xF5-0xFF,
most of which valid UTF-8 never uses): those are left out of the ids, as llama.cpp does
(`Tokenizer.missing_bytes` lists them). Decoding joins the pieces' bytes and reads them as
UTF-8.

GPT-2's vocabulary and merges ship with kvlib (kvlib/gpt2/data/, OpenAI's files; see LICENSE
there); SmolLM2's come from its GGUF file (kvlib.checkpoints.gguf). GPT-2's is
`GPT2Tokenizer` in transformers and the "gpt2" encoding in tiktoken
(tests/test_gpt2_tokenizer.py checks it against tiktoken); SmolLM2's is checked against the
`tokenizers` library (tests/test_smollm2_tokenizer.py).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path

import regex

from .chat import MARK_END, MARK_START, control_token_pattern, encode_around
from .checks import as_flag, as_instance, as_token_ids

DATA = Path(__file__).resolve().parent / "gpt2" / "data"

PRETOKENIZER_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
"""GPT-2's: common English contractions; letters, digits or other symbols, each run with at
most one space in front; whitespace (a run before a word leaves its last space to the word)."""

_NUMBER = regex.compile(r"(\p{N})")

END_OF_TEXT = "<|endoftext|>"
"""GPT-2's only special token, id 50256: it separates documents in training."""


def gpt2_words(text: str) -> list[str]:
    """GPT-2's pre-tokenizer (what_the_heads_read): text -> words, by PRETOKENIZER_PATTERN."""
    return PRETOKENIZER_PATTERN.findall(text)


def smollm_words(text: str) -> list[str]:
    """SmolLM2's pre-tokenizer (model_of_today; llama.cpp calls it "smollm"): every numeral
    (\\p{N}) is a word of its own, then GPT-2's pattern cuts the rest. "in 2024." ->
    ["in", " ", "2", "0", "2", "4", "."]: a number is always read digit by digit."""
    words = []
    for part in _NUMBER.split(text):
        if part:
            words.extend(PRETOKENIZER_PATTERN.findall(part))
    return words


def bytes_to_unicode() -> dict[int, str]:
    """Byte value (0-255) -> the printable character GPT-2 writes it as (what_the_heads_read).

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
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_merges(path) -> list[tuple[str, str]]:
    """merges.txt (GPT-2's vocab.bpe): one merge a line, "Ġ t", highest priority first.

    The first line ("#version: 0.2") is a comment; blank lines are skipped.
    """
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
    """A byte-level BPE tokenizer: GPT-2's (what_the_heads_read) or SmolLM2's (model_of_today).

    >>> tokenizer = Tokenizer.gpt2()
    >>> tokenizer.encode("Hello, I am")
    [15496, 11, 314, 716]
    >>> tokenizer.tokens([15496, 11, 314, 716])
    ['Hello', ',', ' I', ' am']
    >>> tokenizer.decode([15496, 11, 314, 716])
    'Hello, I am'

    vocabulary: token (in bytes_to_unicode characters, "Ġam") -> id; merges: pairs of pieces,
    highest priority first. pretokenize: text -> words (gpt2_words or smollm_words).
    special_tokens: the tokens matched whole in encode's input before anything else (GPT-2:
    "<|endoftext|>", as transformers' GPT2Tokenizer does; tiktoken's encode refuses it unless
    allowed_special says otherwise); encode_ordinary reads them as plain text instead.
    chat_template: a kvlib.chat.ChatTemplate for a chat model (SmolLM2), used by
    apply_chat_template.
    """

    def __init__(self, vocabulary: dict[str, int], merges: list[tuple[str, str]], *,
                 pretokenize: Callable[[str], list[str]] = gpt2_words,
                 special_tokens: Iterable[str] = (END_OF_TEXT,), chat_template=None):
        if not isinstance(vocabulary, dict) or \
                sorted(vocabulary.values()) != list(range(len(vocabulary))):
            raise ValueError("the vocabulary must map each token to its id, the ids being 0, 1, "
                             "..., n - 1 once each")
        self.vocabulary = dict(vocabulary)
        self.merge_ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
        self.pretokenize = pretokenize
        self.special_tokens = tuple(special_tokens)
        self.byte_to_char = bytes_to_unicode()
        self.char_to_byte = {char: byte for byte, char in self.byte_to_char.items()}
        self._check_consistency()
        self.token_bytes = [b""] * len(self.vocabulary)
        for token, token_id in self.vocabulary.items():
            self.token_bytes[token_id] = bytes(self.char_to_byte[char] for char in token)
        for token in self.special_tokens:     # their text, even if not byte characters
            self.token_bytes[self.vocabulary[token]] = token.encode("utf-8")
        self.eot_id = self.vocabulary.get(END_OF_TEXT)
        self.missing_bytes = sorted(byte for byte, char in self.byte_to_char.items()
                                    if char not in self.vocabulary)
        # longest first, so that a special token is never cut by a shorter one inside it
        self._special_pattern = regex.compile("(" + "|".join(
            regex.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)) + ")"
        ) if self.special_tokens else None
        self._control_pattern = control_token_pattern(self.special_tokens)
        self._marked_pattern = regex.compile(
            f"{MARK_START}({self._control_pattern.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
        self._bpe_cache: dict[str, tuple[str, ...]] = {}
        self.chat_template = chat_template

    def _check_consistency(self) -> None:
        for token in self.special_tokens:
            if not isinstance(token, str) or not token or token not in self.vocabulary:
                raise ValueError(f"the special token {token!r} is not in the vocabulary")
        for left, right in self.merge_ranks:
            if left + right not in self.vocabulary:
                raise ValueError(f"the merge {left!r} + {right!r} gives {left + right!r}, "
                                 "which is not in the vocabulary")
        foreign = [token for token in self.vocabulary if token not in self.special_tokens
                   and not set(token) <= self.char_to_byte.keys()]
        if foreign:
            raise ValueError(f"vocabulary tokens {foreign[:5]} use characters that stand for "
                             "no byte (see bytes_to_unicode)")

    @classmethod
    def from_files(cls, vocabulary_path, merges_path, **options) -> Tokenizer:
        """From a vocabulary (vocab.json / encoder.json) and merges (merges.txt / vocab.bpe)."""
        return cls(read_vocabulary(vocabulary_path), read_merges(merges_path), **options)

    @classmethod
    def from_directory(cls, directory, **options) -> Tokenizer:
        """From a folder in the model hub's layout: vocab.json and merges.txt."""
        directory = Path(directory)
        missing = [name for name in ("vocab.json", "merges.txt")
                   if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} has no {' and no '.join(missing)}: a "
                                    "byte-level BPE tokenizer in the model hub's layout needs "
                                    "both")
        return cls.from_files(directory / "vocab.json", directory / "merges.txt", **options)

    @staticmethod
    def gpt2() -> Tokenizer:
        """GPT-2's tokenizer from the files shipped with kvlib (built once, then shared)."""
        return load_tokenizer()

    def __len__(self) -> int:
        return len(self.vocabulary)

    def __repr__(self) -> str:
        return (f"Tokenizer({len(self):,} tokens, {len(self.merge_ranks):,} merges, "
                f"{len(self.special_tokens)} special)")

    def bpe(self, word: str) -> tuple[str, ...]:
        """One pre-token, in bytes_to_unicode characters -> its BPE pieces ("Ġam" -> ("Ġam",)).

        Start from single characters; repeatedly merge the adjacent pair whose merge ranks
        first (the leftmost such pair when it occurs several times), until no adjacent pair
        is a merge. The pairs wait in a heap ordered by (rank, position), so a word of n
        characters takes about n log n steps, not n^2: a pasted URL list or a base64 blob of
        100,000 characters without a space is encoded in about a second (tiktoken and the
        `tokenizers` library do the same).
        """
        if word in self._bpe_cache:
            return self._bpe_cache[word]
        pieces = merge_by_rank(list(word), self.merge_ranks)
        if len(self._bpe_cache) >= 100_000:  # bounded: arbitrary text has no end of words
            self._bpe_cache.clear()
        self._bpe_cache[word] = tuple(pieces)
        return self._bpe_cache[word]

    def encode(self, text: str) -> list[int]:
        """Text -> ids; a special token in the text ("<|endoftext|>") becomes its own id."""
        text = as_instance("text", text, str, "bytes are decoded first")
        if self._special_pattern is None:
            return self._encode_words(text)
        return encode_around(self._special_pattern.split(text), self.vocabulary,
                             self._encode_words)

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, with no special tokens: "<|endoftext|>" is encoded as plain text."""
        return self._encode_words(as_instance("text", text, str, "bytes are decoded first"))

    def encode_marked(self, text: str) -> list[int]:
        """Text rendered from marked messages (kvlib.chat.mark_control_tokens) -> ids
        (model_of_today): a control token between MARK_START and MARK_END is encoded as plain
        text, without its markers; the rest of the text, the template's own markers
        included, as encode does. A lone marker is dropped but still cuts the text, so that
        the text on either side cannot join into a control token. Text without markers gives
        what encode gives."""
        text = as_instance("text", text, str, "bytes are decoded first")
        pieces = self._marked_pattern.split(text)       # [text, token or None, text, ...]
        ids = self.encode(pieces[0])
        for number, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_words(piece) if number % 2 else self.encode(piece)
        return ids

    def _encode_words(self, text: str) -> list[int]:
        """Steps 1-4 of the module's docstring, on text already checked."""
        ids = []
        for word in self.pretokenize(text):
            characters = "".join(self.byte_to_char[byte] for byte in word.encode("utf-8"))
            # a byte with no token of its own (missing_bytes) is left out, as llama.cpp and
            # the tokenizers library do; merges only ever make pieces in the vocabulary
            ids.extend(self.vocabulary[piece] for piece in self.bpe(characters)
                       if piece in self.vocabulary)
        return ids

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            tokenize: bool = True, *, parse_special: bool = False):
        """A conversation as the model reads it (model_of_today), as transformers' method of the
        same name: messages [{"role": "user", "content": "..."}] -> ids (or the text, with
        tokenize=False). add_generation_prompt opens the assistant's turn.

        Only the template's own markers become control tokens: a control token typed inside
        a message ("<|im_start|>") is encoded as plain text, so that no message can forge a
        turn (transformers 5.25's sanitize_control_tokens=True). parse_special=True encodes
        the rendered text whole, control tokens parsed wherever they are: the default of
        transformers' apply_chat_template and of llama.cpp's server. A conversation that
        types no control token gets the same ids either way."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template: it is not a chat model's")
        add_generation_prompt = as_flag("add_generation_prompt", add_generation_prompt)
        tokenize, parse_special = as_flag("tokenize", tokenize), as_flag("parse_special",
                                                                         parse_special)
        if not tokenize or parse_special:
            text = self.chat_template.render(messages, add_generation_prompt)
            return self.encode(text) if tokenize else text
        return self.encode_marked(self.chat_template.render(messages, add_generation_prompt,
                                                            mark=self._control_pattern))

    def decode(self, ids) -> str:
        """Ids -> text; a character whose UTF-8 bytes the ids leave incomplete shows as U+FFFD."""
        ids = as_token_ids(ids, len(self), what="token ids", empty=True)
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def tokens(self, ids) -> list[str]:
        """Ids -> each token's own text, for labels: [" am", ...] (the space kept, not "Ġ").

        A token holding only part of a character's UTF-8 bytes shows them as escapes ("\\xf0").
        """
        return [self.token_bytes[i].decode("utf-8", errors="backslashreplace")
                for i in as_token_ids(ids, len(self), what="token ids", empty=True)]

def merge_by_rank(pieces: list[str], merge_ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE's merge loop (step 3): merge the best-ranked adjacent pair, leftmost first, until
    no adjacent pair is a merge; pieces -> the merged pieces (merge_pairs, keyed by rank)."""
    return merge_pairs(pieces, lambda left, right: merge_ranks.get((left, right)))


def merge_pairs(pieces: list[str], priority) -> list[str]:
    """The merge loop of byte-pair encoding, GPT-2's (by rank) and SentencePiece's (by score):
    merge the adjacent pair whose priority(left, right) is lowest, the leftmost among equal
    ones, until priority is None for every adjacent pair; pieces -> the merged pieces (the
    list given is used up).

    The pieces form a linked list (previous / following index) and every adjacent pair that can
    merge waits in a heap keyed by (priority, position). A heap entry goes stale when one of
    its two pieces has since been merged into something else; it is recognised by the pieces
    it names and skipped. n pieces take about n log n steps.
    """
    following = list(range(1, len(pieces))) + [-1]
    previous = list(range(-1, len(pieces) - 1))
    heap = []

    def push(i: int) -> None:                 # the pair starting at piece i, if it can merge
        j = following[i] if i >= 0 else -1
        if j >= 0 and (key := priority(pieces[i], pieces[j])) is not None:
            heapq.heappush(heap, (key, i, pieces[i], pieces[j]))

    for i in range(len(pieces) - 1):
        push(i)
    while heap:
        _, i, left, right = heapq.heappop(heap)
        j = following[i] if pieces[i] is not None else -1
        if j < 0 or pieces[i] != left or pieces[j] != right:
            continue                          # stale: a piece of it was merged away
        pieces[i], pieces[j] = left + right, None
        following[i] = following[j]
        if following[j] >= 0:
            previous[following[j]] = i
        push(previous[i])
        push(i)
    return [piece for piece in pieces if piece is not None]


@lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    """GPT-2's tokenizer from kvlib/gpt2/data/ (encoder.json, vocab.bpe); built once."""
    return Tokenizer.from_files(DATA / "encoder.json", DATA / "vocab.bpe")
