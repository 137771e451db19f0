"""A SentencePiece-style tokenizer: Gemma 3's, read from its GGUF file (llama.cpp's "llama"
vocabulary), written to be read.

Where byte-level BPE (kvlib.bpe, GPT-2 and SmolLM2) turns text into bytes and merges by a
list of learned pairs, a SentencePiece vocabulary is a list of pieces of text, each with a
score and a type:

- NORMAL pieces ("▁the", "ing", "日本語"): what the merges build; a space is written "▁"
  (U+2581), so a word's leading space is part of its piece;
- USER_DEFINED pieces: matched whole in the raw text before anything else (Gemma 3: runs of
  2-31 spaces, of newlines and of tabs, HTML tags such as <b> and <code>);
- CONTROL pieces (<bos>, <eos>, <start_of_turn>, ...): never made from text that was typed,
  only put there by the program (encode's add_bos), unless parse_special=True says that
  control tokens written in the text are meant as such;
- BYTE pieces <0x00> .. <0xFF>: the fallback for a character the vocabulary lacks, one per
  UTF-8 byte, so that any text can be encoded.

Text becomes ids in four steps:
1. the user-defined pieces are cut out of the text, longest first (leftmost first among
   equals), as llama.cpp and transformers do; each becomes its id;
2. in what is left, every space becomes "▁" (no space is added in front: Gemma sets
   add_space_prefix to false);
3. starting from single characters, the adjacent pair whose concatenation is the
   highest-scoring piece is merged, the leftmost when a pair occurs twice, until no
   adjacent pair makes a piece (llama.cpp's llm_tokenizer_spm; Gemma's scores fall with
   the piece's place in the file, which is the order transformers merges in);
4. each resulting piece becomes its id; a character that is no piece becomes its UTF-8
   bytes' <0xXX> ids.

Decoding joins the pieces' text ("▁" back to a space, byte pieces as their bytes) and reads
it as UTF-8. A "▁" typed in the text therefore comes back as a space.

Gemma 3 270M's file holds 262,144 pieces: 255,474 normal, 6,249 control, 165 user-defined,
256 bytes; BOS is 2 (added in front by encode) and EOS is 1. tests/test_sentencepiece.py
compares this tokenizer with transformers' (5.25) built from the same file.
"""

from __future__ import annotations

import numpy as np
import regex

from .bpe import merge_pairs
from .chat import encode_around

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""llama.cpp's token types (the GGUF's tokenizer.ggml.token_type), SentencePiece's own."""

SPACE = "\u2581"
"""How SentencePiece writes a space inside a piece: "▁" (U+2581, LOWER ONE EIGHTH BLOCK)."""

_BYTE_PIECE = regex.compile(r"<0x([0-9A-F]{2})>")


class SentencePieceTokenizer:
    """Gemma 3's tokenizer from its vocabulary (notebook on Gemma 3).

    >>> tokenizer = kvlib.checkpoints.gemma3.gemma3_tokenizer()
    >>> tokenizer.encode("Hello world")
    [2, 9259, 1902]
    >>> tokenizer.tokens([2, 9259, 1902])
    ['<bos>', 'Hello', ' world']
    >>> tokenizer.decode([2, 9259, 1902])
    'Hello world'

    tokens, scores, token_types: one entry per id, as the GGUF file lists them
    (tokenizer.ggml.tokens, .scores, .token_type). bos_id, eos_id: the ids encode puts in
    front and generation stops at.
    """

    def __init__(self, tokens, scores, token_types, *, bos_id: int | None = None,
                 eos_id: int | None = None):
        _check_vocabulary(tokens, scores, token_types, bos_id, eos_id)
        self.pieces = list(tokens)
        self.types = np.asarray(token_types, dtype=np.int64)
        self.bos_id, self.eos_id = bos_id, eos_id
        # step 3 merges into normal pieces only: a control or byte piece never comes from text
        self.scores = {piece: float(score) for piece, score, kind in
                       zip(self.pieces, scores, token_types) if kind == NORMAL}
        self.ids = {piece: i for i, (piece, kind) in enumerate(zip(self.pieces, token_types))
                    if kind == NORMAL}
        self.user_defined = {piece: i for i, (piece, kind) in
                             enumerate(zip(self.pieces, token_types)) if kind == USER_DEFINED}
        self.control = {piece: i for i, (piece, kind) in
                        enumerate(zip(self.pieces, token_types)) if kind == CONTROL}
        self.byte_ids = {}
        for i, (piece, kind) in enumerate(zip(self.pieces, token_types)):
            if kind == BYTE:
                self.byte_ids[int(_BYTE_PIECE.fullmatch(piece).group(1), 16)] = i
        self.token_bytes = [_piece_bytes(piece, kind) for piece, kind in
                            zip(self.pieces, token_types)]
        self._plain = _longest_first(self.user_defined)
        self._special = None        # with the control tokens too: made when first asked for
        self._whole = self.user_defined | self.control

    def __len__(self) -> int:
        return len(self.pieces)

    def __repr__(self) -> str:
        counts = {name: int((self.types == kind).sum()) for name, kind in
                  (("normal", NORMAL), ("control", CONTROL), ("user-defined", USER_DEFINED),
                   ("byte", BYTE))}
        return (f"SentencePieceTokenizer({len(self):,} pieces: "
                + ", ".join(f"{n:,} {name}" for name, n in counts.items()) + ")")

    def encode(self, text: str, *, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> ids (steps 1-4 of the module's docstring), BOS first unless add_bos=False.

        Control tokens written in the text ("<start_of_turn>") are read as plain text by
        default, as a chat program must read a user's message; parse_special=True turns
        them into their ids (llama.cpp's parse_special, transformers' default). The empty
        text gives [BOS].
        """
        _check_text(text)
        for name, value in (("add_bos", add_bos), ("parse_special", parse_special)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        if parse_special and self._special is None:    # Gemma's 6,414 pieces: about 2 s
            self._special = _longest_first(self.user_defined | self.control)
        pattern = self._special if parse_special else self._plain
        parts = pattern.split(text) if pattern is not None else [text]
        return ids + encode_around(parts, self._whole, self._encode_fragment)

    def _encode_fragment(self, text: str) -> list[int]:
        """Steps 2-4 on text without user-defined pieces."""
        ids = []
        for piece in merge_by_score(list(text.replace(" ", SPACE)), self.scores):
            if piece in self.ids:
                ids.append(self.ids[piece])
            else:                                      # a character no piece holds
                ids.extend(self.byte_ids[byte] for byte in piece.encode("utf-8"))
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Ids -> text: pieces joined, "▁" read as a space, byte pieces as their bytes, the
        whole read as UTF-8 (an incomplete character shows as U+FFFD). Control tokens (BOS,
        EOS, ...) are left out unless skip_special_tokens=False, so that
        decode(encode(text)) == text."""
        ids = self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if self.types[i] != CONTROL]
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def tokens(self, ids) -> list[str]:
        """Ids -> each token's own text, for labels: [" world", "<bos>", ...] (the space shown
        as a space); a byte piece that is part of a character shows as an escape ("\\xe6")."""
        return [self.token_bytes[i].decode("utf-8", errors="backslashreplace")
                for i in self._check_ids(ids)]

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, (int, np.integer)) and not isinstance(ids, (bool, np.bool_)):
            ids = [ids]
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise TypeError(f"ids must be a 1-D array of integers, got shape {ids.shape} "
                                f"and dtype {ids.dtype}")
            ids = ids.tolist()
        if isinstance(ids, (str, bytes, dict, set)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ids must be a sequence of integers, got {type(ids).__name__}")
        ids = list(ids)
        wrong = [i for i in ids if isinstance(i, (bool, np.bool_))
                 or not isinstance(i, (int, np.integer))]
        if wrong:
            raise TypeError(f"ids must be integers, got {wrong[:5]!r}")
        outside = [int(i) for i in ids if not 0 <= i < len(self)]
        if outside:
            raise ValueError(f"ids {outside[:5]} are outside the vocabulary: valid ids are 0 "
                             f"to {len(self) - 1}")
        return [int(i) for i in ids]


def merge_by_score(symbols: list[str], scores: dict[str, float]) -> list[str]:
    """SentencePiece's merge loop (step 3): symbols -> pieces. While some adjacent pair
    concatenates to a piece of the vocabulary, merge the pair whose piece scores highest (the
    leftmost among equal ones): kvlib.bpe.merge_pairs, keyed by -score."""

    def priority(left: str, right: str) -> float | None:
        score = scores.get(left + right)
        return None if score is None else -score

    return merge_pairs(symbols, priority)


def _longest_first(pieces: dict[str, int]):
    """A pattern that finds any of the pieces, the longest where several start at one place
    (regex tries the alternatives in order), as one group; None for no pieces."""
    if not pieces:
        return None
    ordered = sorted(pieces, key=lambda piece: (-len(piece), piece))
    return regex.compile("(" + "|".join(regex.escape(piece) for piece in ordered) + ")")


def _piece_bytes(piece: str, kind: int) -> bytes:
    """What a piece stands for in decoded text."""
    if kind == BYTE:
        return bytes([int(_BYTE_PIECE.fullmatch(piece).group(1), 16)])
    return piece.replace(SPACE, " ").encode("utf-8")


def _check_vocabulary(tokens, scores, token_types, bos_id, eos_id) -> None:
    """The parts of a SentencePieceTokenizer, before any is used."""
    for name, values in (("tokens", tokens), ("scores", scores), ("token_types", token_types)):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"{name} must be a list with one entry per id, got "
                            f"{type(values).__name__}")
    if not len(tokens) == len(scores) == len(token_types) or not len(tokens):
        raise ValueError(f"tokens, scores and token_types must be lists of one length > 0, got "
                         f"{len(tokens)}, {len(scores)} and {len(token_types)}")
    if not all(isinstance(token, str) and token for token in tokens):
        raise TypeError("every token must be a non-empty str")
    if len(set(tokens)) != len(tokens):
        raise ValueError("the vocabulary lists a token twice")
    if not set(np.asarray(token_types).tolist()) <= {NORMAL, UNKNOWN, CONTROL, USER_DEFINED,
                                                     UNUSED, BYTE}:
        raise ValueError("token_types must be llama.cpp's types 1-6 (normal, unknown, control, "
                         "user-defined, unused, byte)")
    found = {int(_BYTE_PIECE.fullmatch(token).group(1), 16) for token, kind in
             zip(tokens, token_types) if kind == BYTE and _BYTE_PIECE.fullmatch(token)}
    if len(found) != 256 or sum(kind == BYTE for kind in token_types) != 256:
        raise ValueError("a byte-fallback vocabulary needs the 256 byte pieces <0x00> .. <0xFF>, "
                         "each once, typed as bytes (6)")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < len(tokens)):
            raise ValueError(f"{name} must be an id of the vocabulary or None, got {value!r}")


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise TypeError(f"encode expects a str, got {type(text).__name__}"
                        + (": decode the bytes first" if isinstance(text, bytes) else ""))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the text holds {text[error.start]!r} at position {error.start}, a "
                         "lone surrogate, which is no character and has no UTF-8 bytes") from None


__all__ = ["BYTE", "CONTROL", "NORMAL", "SPACE", "SentencePieceTokenizer", "UNKNOWN", "UNUSED",
           "USER_DEFINED", "merge_by_score"]
