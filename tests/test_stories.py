"""The stories grammar, its tokenizer, the packed sequences and the shipped model files
(notebooks 12 and 13), without torch: the behaviour of the models is in
test_stories_model.py."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stories_model import DRAFT, MODELS, TARGET, with_a_valid_made_up_song

from kvlib.stories import (
    StoryTokenizer,
    corpus,
    first_error,
    forced_repeats,
    generate_stories,
    generate_story,
    grammar,
    is_grammatical,
    slot_of_each_word,
    text_to_words,
    words_to_text,
)

MAX_FILE_BYTES = 2 * 1024 * 1024

OPENING = ("Once upon a time, there was a shy girl named Mia. Mia had a red ball. "
           "Mia had a friend named Tom. Tom got a blue kite from his dad.")
SONG = " Mia made up a song: la dee boom hop zip tra."


# --- the grammar ---------------------------------------------------------------------------

def test_the_same_seed_gives_the_same_stories_and_another_seed_others():
    assert generate_stories(5, 3) == generate_stories(5, 3)
    assert generate_stories(5, 3) != generate_stories(5, 4)
    assert generate_stories(5, 3)[:2] == generate_stories(2, 3)
    first = generate_story(np.random.default_rng(11))
    assert first == generate_story(np.random.default_rng(11))


def test_a_story_has_two_characters_a_thing_each_and_repeats_them():
    story = generate_stories(1, 0)[0]
    words = text_to_words(story)
    names = [w for w in words if w in grammar.GIRL_NAMES + grammar.BOY_NAMES]
    assert len(set(names)) == 2
    assert len(names) > 6  # introduced once, then repeated
    assert sum(w in grammar.ADJECTIVES for w in words) >= 4
    song = [w for w in words if w in grammar.SONG_WORDS]
    assert len(song) == 4 * grammar.SONG_LENGTH  # made up, then sung three times
    assert song == song[:grammar.SONG_LENGTH] * 4 and len(set(song)) == grammar.SONG_LENGTH
    assert 60 < len(words) < 200


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_every_generated_story_is_grammatical_and_survives_text_round_trips(seed):
    stories = generate_stories(3, seed)
    text = "\n\n".join(stories)
    assert first_error(text) is None
    words = text_to_words(text)
    assert words.count(grammar.BOS) == 3 and words[0] == grammar.BOS
    assert words_to_text(words) == text
    tokenizer = StoryTokenizer()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.tokens(ids) == words


def test_many_stories_use_every_word_of_the_vocabulary():
    used = {w for story in generate_stories(600, 1) for w in text_to_words(story)}
    assert used == set(grammar.VOCABULARY)


NO_FIT = "no character or thing of this story fits"

UNGRAMMATICAL = [
    # (text, a piece of the diagnosis)
    (OPENING.replace("from his dad", "from her dad"), "allows his"),
    (OPENING + " Mia and Sam went to the park.", "allows Tom"),
    (OPENING + " Mia said hello to Mia.", "allows Tom"),
    (OPENING + " Mia played with her blue kite.", "allows red"),
    (OPENING + " Mia played with her red kite.", "allows ball"),
    (OPENING + " Tom played with his red ball.", "allows blue"),
    (OPENING + " Tom found the red ball under the bed.", NO_FIT),
    (OPENING + " Mia lost her red ball. Tom found the blue kite under the bed.", "allows red"),
    (OPENING + " One day, Mia met a kind boy named Ben.", NO_FIT),
    ("Once upon a time, there was a shy girl named Tom.", "allows Mia"),
    ("Once upon a time, there was a shy girl named Mia. Mia had a friend named Mia.",
     "not \"Mia\""),
    (OPENING + " Mia had a green hat.", "allows friend, not \"green\""),  # she has a thing
    (OPENING.replace("blue kite", "red kite"), "not \"red\""),
    (OPENING + " Mia gave the blue kite back to Mia.", "allows Tom"),
    (OPENING + " Tom gave the blue kite back to Tom.", NO_FIT),
    (OPENING + " Mia told Tom about the fox.", NO_FIT),
    (OPENING + " Mia was happy", "does not end with a full stop"),
    (OPENING + " Mia saw a dragon.", "unknown word(s) ['dragon']"),
    (OPENING + " Had Mia a red ball.", "no sentence of the grammar starts like"),
    (OPENING.replace("Mia had a red", "Mia had a a red"), "not \"a\""),
    (OPENING + " Mia was happy happy.", "allows ."),
    (OPENING + " Mia and Tom went to the park", "does not end with a full stop"),
    (OPENING + " Mia had a. Tom was sad.", "not \".\""),
    ("Mia had a red ball.", "is about Mia, but the story has no such character"),
    (OPENING + SONG + " Tom sang: la dee boom hop tra zip.", "allows zip, not \"tra\""),
    (OPENING + " Tom sang: la dee boom hop zip tra.", NO_FIT),     # no song made up yet
    (OPENING + SONG + " Tom made up a song: la dee boom hop zip tra.", NO_FIT),  # one song
    (OPENING + " Mia made up a song: la la boom hop zip tra.", "not \"la\""),   # six sounds
    (OPENING + SONG + " Tom sang: la dee boom hop zip.", "allows tra, not \".\""),
    (OPENING + "\n\nMia was happy.", "story 2"),  # a new story forgets the characters
    (OPENING + " <bos> <bos> " + OPENING, "story 2 is empty"),
]


@pytest.mark.parametrize("text, diagnosis", UNGRAMMATICAL)
def test_corrupted_stories_are_not_grammatical_and_the_error_says_why(text, diagnosis):
    assert not is_grammatical(text)
    assert not is_grammatical(text, allow_unfinished=True) or "full stop" in diagnosis
    error = first_error(text)
    assert diagnosis in error, error


GRAMMATICAL = [
    OPENING,
    OPENING.lower(),                                          # case is ignored
    OPENING.replace(". ", ".\n"),                             # line breaks inside a story
    "<bos> " + OPENING,                                       # BOS written out
    OPENING + "\n\n" + OPENING,                               # two stories
    OPENING + " <bos> " + OPENING.replace("Tom", "Ben"),      # BOS as the separator
    OPENING + " Tom and Mia went to the park.",               # the sentences in any order
    OPENING + " Mia lost her red ball. Tom found the red ball under the bed. "
              "Tom gave the red ball back to Mia.",
    OPENING + " They saw a fox near the river. Tom told Mia about the fox.",
    OPENING + SONG + " Tom sang: la dee boom hop zip tra. Mia and Tom sang the song: la dee "
                     "boom hop zip tra.",
    "",
]


@pytest.mark.parametrize("text", GRAMMATICAL)
def test_valid_texts_in_other_forms_are_grammatical(text):
    assert first_error(text) is None


def test_an_unfinished_last_sentence_is_accepted_only_when_asked_and_only_at_the_end():
    unfinished = OPENING + " Mia and Tom went to the"
    assert not is_grammatical(unfinished)
    assert is_grammatical(unfinished, allow_unfinished=True)
    assert is_grammatical(OPENING + "\n\n", allow_unfinished=True)  # a new story just began
    assert not is_grammatical(OPENING + " Mia and Tom went to the bed", allow_unfinished=True)
    assert not is_grammatical(OPENING + " Mia and Tom went\n\n" + OPENING,
                              allow_unfinished=True)


def test_generating_rejects_what_is_not_a_generator_or_a_count():
    with pytest.raises(TypeError, match="numpy Generator"):
        generate_story(0)
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises((TypeError, ValueError), match="n must be (a whole number|at least 0)"):
            generate_stories(bad, 0)
    with pytest.raises(TypeError, match="string"):
        first_error(["Mia"])


# --- the ground truth for the heads --------------------------------------------------------

def test_forced_repeats_marks_the_forced_names_and_their_earlier_occurrences():
    text = OPENING + " Mia and Tom went to the park. Tom said thank you to Mia."
    words = text_to_words(text)
    repeats = forced_repeats(words, "name")
    # "Mia and Tom": Tom is forced; "thank you to Mia": Mia is forced
    assert [(r.position, r.word) for r in repeats] == [
        (words.index("and") + 1, "Tom"), (len(words) - 2, "Mia")]
    tom, mia = repeats
    assert [words[j] for j in tom.earlier] == ["Tom", "Tom"]
    assert [words[j] for j in tom.distractor] == ["Mia"] * 4
    assert max(tom.earlier) < tom.position and max(mia.earlier) < mia.position
    assert set(mia.distractor) == {j for j in range(mia.position) if words[j] == "Tom"}


def test_forced_repeats_of_things_and_of_the_song():
    words = text_to_words(OPENING + SONG + " Tom played with his blue kite. Tom sang: la dee "
                          "boom hop zip tra.")
    (kite,) = forced_repeats(words, "thing")
    assert (kite.word, words[kite.position - 1]) == ("kite", "blue")
    assert [words[j] for j in kite.earlier] == ["kite"]
    assert [words[j] for j in kite.distractor] == ["ball"]
    song = forced_repeats(words, "song")
    assert [r.word for r in song] == ["la", "dee", "boom", "hop", "zip", "tra"]
    first = words.index("la")
    assert [r.earlier for r in song] == [(first + i,) for i in range(6)]
    # the song's other sounds: as made up, and "la dee" just sung before "boom"
    assert song[2].distractor == (first, first + 1, first + 3, first + 4, first + 5,
                                  song[0].position, song[1].position)
    with pytest.raises(ValueError, match="kind must be one of"):
        forced_repeats(words, "animal")


def test_forced_repeats_start_afresh_in_every_story_and_need_a_grammatical_text():
    words = text_to_words(OPENING + " Mia said hello to Tom.\n\n" + OPENING +
                          " Tom said hello to Mia.")
    first, second = forced_repeats(words, "name")
    second_story = words.index(grammar.BOS, 1)
    assert all(j > second_story for j in second.earlier + second.distractor)
    assert all(j < second_story for j in first.earlier + first.distractor)
    slots = slot_of_each_word(words)
    assert slots[words.index("named") + 1] == "new_name" and slots[0] is None
    with pytest.raises(ValueError, match="not a text of the grammar"):
        forced_repeats(text_to_words(OPENING + " Mia said hello to Mia."), "name")


# --- the tokenizer -------------------------------------------------------------------------

def test_tokenizer_round_trip_bos_and_case():
    tokenizer = StoryTokenizer()
    ids = tokenizer.encode("Mia had a red ball.")
    assert tokenizer.tokens(ids) == ["<bos>", "Mia", "had", "a", "red", "ball", "."]
    assert ids[0] == tokenizer.bos_id == 0
    assert tokenizer.encode("mia HAD a Red ball .") == ids
    assert tokenizer.decode(ids) == "Mia had a red ball."
    assert tokenizer.encode("Mia had a red ball.", add_bos=False) == ids[1:]
    two = tokenizer.encode("Mia was sad.\n\nTom was happy.")
    assert two.count(0) == 2 and tokenizer.decode(two) == "Mia was sad.\n\nTom was happy."
    assert tokenizer.decode(np.array(two)) == tokenizer.decode(two)
    assert len(tokenizer) == len(grammar.VOCABULARY)
    assert len({w.lower() for w in tokenizer.vocabulary}) == len(tokenizer)  # case-free ids


@pytest.mark.parametrize("text, error, message", [
    ("Mia had a dragon.", ValueError, r"unknown word\(s\) \['dragon'\]"),
    ("Mia had a red ball!", ValueError, r"unknown word\(s\) \['!'\]"),
    (42, TypeError, "string"),
])
def test_tokenizer_encode_errors(text, error, message):
    with pytest.raises(error, match=message):
        StoryTokenizer().encode(text)


@pytest.mark.parametrize("ids, error, message", [
    ([3, 9999], ValueError,
     rf"id\(s\) \[9999\] are outside .* 0 and {len(grammar.VOCABULARY) - 1}"),
    ([-1], ValueError, "outside"),
    ([1.5], TypeError, "whole numbers"),
    ([[1, 2]], TypeError, "whole numbers"),
    ("Mia", TypeError, "token ids"),
])
def test_tokenizer_decode_errors(ids, error, message):
    with pytest.raises(error, match=message):
        StoryTokenizer().decode(ids)


def test_from_directory_rejects_a_missing_or_broken_vocabulary(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        StoryTokenizer.from_directory(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"<bos>": 0, "a": 2}))
    with pytest.raises(ValueError, match="ids 0 to n-1"):
        StoryTokenizer.from_directory(tmp_path)


# --- the packed sequences ------------------------------------------------------------------

def test_pack_lays_whole_stories_one_after_another_and_cuts_the_last():
    stories = [[0, 1, 2], [0, 3, 4, 5], [0, 6], [0, 7, 8, 9, 10, 11]]
    assert corpus.pack(stories, 5).tolist() == [[0, 1, 2, 0, 3], [0, 6, 0, 7, 8]]
    assert corpus.pack(stories, 5, n_sequences=1).tolist() == [[0, 1, 2, 0, 3]]
    assert corpus.pack(stories, 100).shape == (0, 100)
    with pytest.raises(ValueError, match="at least 2"):
        corpus.pack(stories, 1)


def test_story_sequences_are_seeded_start_with_bos_and_read_as_stories():
    sequences = corpus.story_sequences(6, corpus.HELD_OUT_SEED)
    assert sequences.shape == (6, corpus.CONTEXT_LENGTH) and sequences.dtype == np.int64
    assert np.array_equal(sequences, corpus.story_sequences(6, corpus.HELD_OUT_SEED))
    assert not np.array_equal(sequences, corpus.story_sequences(6, corpus.TRAINING_SEED))
    assert (sequences[:, 0] == 0).all()
    assert all((s == 0).sum() >= 2 for s in sequences)  # several stories in each
    tokenizer = StoryTokenizer()
    for sequence in sequences:
        assert is_grammatical(tokenizer.decode(sequence), allow_unfinished=True)


# --- the shipped files ---------------------------------------------------------------------

def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(length))


@pytest.mark.parametrize("directory", [TARGET, DRAFT], ids=["target", "draft"])
def test_shipped_files_exist_are_small_and_hold_the_vocabulary(directory):
    for name in ("config.json", "model.safetensors", "vocab.json", "measured.json"):
        path = directory / name
        assert path.is_file(), f"{path} is missing: run tools/train_stories.py"
        assert path.stat().st_size < MAX_FILE_BYTES
    vocabulary = json.loads((directory / "vocab.json").read_text())
    assert list(vocabulary) == list(grammar.VOCABULARY)
    assert list(vocabulary.values()) == list(range(len(grammar.VOCABULARY)))
    assert StoryTokenizer.from_directory(directory).vocabulary == grammar.VOCABULARY


MODEL_CARD = MODELS / "README.md"


def model_card_sizes() -> dict:
    """The sizes table of kvlib/models/README.md: model -> {column: value}."""
    lines = [line for line in MODEL_CARD.read_text().splitlines() if line.startswith("| `")]
    header = [c.strip() for c in next(line for line in MODEL_CARD.read_text().splitlines()
                                      if line.startswith("| model")).strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:]))
    return rows


@pytest.mark.parametrize("directory, layers, d_model, heads", [
    (TARGET, 4, 96, 4), (DRAFT, 1, 64, 4)], ids=["target", "draft"])
def test_config_is_gpt2_at_the_sizes_the_model_card_gives(directory, layers, d_model, heads):
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    assert config["activation_function"] == "gelu_new"
    assert config["tie_word_embeddings"] is True
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0
    assert config["bos_token_id"] == 0 and config["n_inner"] is None
    assert (config["n_layer"], config["n_embd"], config["n_head"]) == (layers, d_model, heads)
    assert config["n_positions"] == corpus.CONTEXT_LENGTH
    assert config["vocab_size"] == len(grammar.VOCABULARY)
    card = model_card_sizes()[f"stories{'-draft' if directory == DRAFT else ''}"]
    assert (int(card["layers"]), int(card["d_model"]), int(card["heads"]),
            int(card["context"]), int(card["vocabulary"])) == (
        layers, d_model, heads, config["n_positions"], config["vocab_size"])


@pytest.mark.parametrize("directory", [TARGET, DRAFT], ids=["target", "draft"])
def test_weights_are_float16_gpt2_tensors_of_the_configured_shapes(directory):
    config = json.loads((directory / "config.json").read_text())
    d, V, T = config["n_embd"], config["vocab_size"], config["n_positions"]
    header = safetensors_header(directory / "model.safetensors")
    header.pop("__metadata__", None)
    expected = {"transformer.wte.weight": [V, d], "transformer.wpe.weight": [T, d],
                "transformer.ln_f.weight": [d], "transformer.ln_f.bias": [d]}
    for layer in range(config["n_layer"]):
        prefix = f"transformer.h.{layer}."
        expected.update({
            prefix + "ln_1.weight": [d], prefix + "ln_1.bias": [d],
            prefix + "attn.c_attn.weight": [d, 3 * d], prefix + "attn.c_attn.bias": [3 * d],
            prefix + "attn.c_proj.weight": [d, d], prefix + "attn.c_proj.bias": [d],
            prefix + "ln_2.weight": [d], prefix + "ln_2.bias": [d],
            prefix + "mlp.c_fc.weight": [d, 4 * d], prefix + "mlp.c_fc.bias": [4 * d],
            prefix + "mlp.c_proj.weight": [4 * d, d], prefix + "mlp.c_proj.bias": [d],
        })
    assert {name: entry["shape"] for name, entry in header.items()} == expected
    assert {entry["dtype"] for entry in header.values()} == {"F16"}
    n_parameters = sum(int(np.prod(shape)) for shape in expected.values())
    measured = json.loads((directory / "measured.json").read_text())
    assert measured["parameters"] == n_parameters
    assert measured["file_bytes"] == (directory / "model.safetensors").stat().st_size


@pytest.mark.parametrize("directory", [TARGET, DRAFT], ids=["target", "draft"])
def test_measured_greedy_continuations_are_grammatical_text(directory):
    measured = json.loads((directory / "measured.json").read_text())
    assert measured["greedy"]
    for sample in measured["greedy"]:
        text = sample["opening"] + " " + sample["continuation"]
        assert sample["grammatical"] == is_grammatical(text, allow_unfinished=True)
    if directory == TARGET:  # the model card: every rule holds but a made-up song's sounds
        for sample in measured["greedy"]:
            # its first 40 words keep every rule but a made-up song's different sounds
            words = text_to_words(with_a_valid_made_up_song(
                sample["opening"] + " " + sample["continuation"]))
            opening = len(text_to_words(sample["opening"]))
            assert first_error(words_to_text(words[:opening + 40]),
                               allow_unfinished=True) is None
