"""A small grammar of children's stories, the corpus of the trained model (real_model).

Each story introduces two characters and one thing each (with an adjective), and later
sentences must repeat them: "Mia had a red ball. ... Tom asked Mia to help. ... At last, Tom
found the red ball under the bed." Predicting "Mia" after "asked", or "ball" after "the red",
needs the keys and values of positions far back: what a decode step needs the cache for. The
second character and the second thing are distractors: copying must pick the right one.

One definition serves both directions. A sentence is a template of words and slots; a slot's
allowed words follow from the story so far (`allowed_words`). The generator fills each slot
with one of its allowed words, chosen uniformly; the checker accepts a sentence when some
template matches it word by word. So every generated story is grammatical by construction,
and a greedy continuation of the model can be checked against the same rules.

The core of kvlib: numpy (for the seeded generator) and the standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..checks import as_flag, as_instance, as_one_of, as_whole_number
from ..tokenizer import BOS

GIRL_NAMES = (
    "Mia", "Lily", "Emma", "Anna", "Sara", "Lucy", "Ella", "Zoe", "Amy", "Nora",
    "Ruby", "Iris", "Maya", "Rosa", "Alice", "Greta", "Chloe", "Hannah", "Julia", "Kate",
    "Laura", "Nina", "Olivia", "Sophie", "Tina", "Vera", "Wendy", "Yara", "Clara", "Dora",
)
BOY_NAMES = (
    "Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Noah", "Liam", "Finn", "Oscar",
    "Hugo", "Theo", "Adam", "Eric", "Felix", "Henry", "Ivan", "Jonas", "Kevin", "Luke",
    "Marco", "Nick", "Owen", "Paul", "Ryan", "Simon", "Victor", "Walter", "Oliver", "David",
)

# Word classes that a slot draws from freely (the story's state does not restrict them).
# Every word starts with a consonant, so that "a" is always the right article.
FREE_WORDS = {
    "trait": ("little", "kind", "brave", "shy", "happy", "curious", "clever", "quiet",
              "funny", "gentle"),
    "child": ("girl", "boy"),
    "family": ("mom", "dad", "grandma", "grandpa", "aunt", "uncle"),
    "place": ("park", "garden", "beach", "forest", "river", "lake", "school", "market",
              "farm", "hill", "library", "zoo", "playground", "meadow", "village", "castle"),
    "furniture": ("bed", "table", "chair", "sofa", "tree", "bench", "rug", "bush", "desk",
                  "door"),
    "feeling": ("happy", "sad", "tired", "scared", "excited", "hungry", "sleepy", "proud",
                "worried", "calm"),
    "weather": ("sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy", "bright"),
    "animal": ("dog", "cat", "bird", "frog", "duck", "rabbit", "horse", "cow", "fox", "goat",
               "mouse", "squirrel"),
    "food": ("cake", "cookie", "banana", "sandwich", "pie", "muffin", "pear", "peach"),
}
ADJECTIVES = ("red", "blue", "green", "yellow", "purple", "pink", "white", "black", "brown",
              "gray", "big", "small", "shiny", "soft", "new", "striped", "wooden", "tiny",
              "golden", "silver")
"""Adjectives of the characters' things; each story gives its two things different ones."""
SONG_WORDS = ("la", "lee", "loo", "da", "dee", "doo", "ding", "dong", "boom", "bam", "hop",
              "zip", "zap", "tra", "ho", "hey")
"""The sounds of a song: a story's song strings SONG_LENGTH different ones together, and the
characters sing it again later, word for word (copying a sequence: an induction head's job)."""
SONG_LENGTH = 6
THINGS = ("ball", "kite", "book", "hat", "cup", "doll", "car", "boat", "drum", "box", "bike",
          "train", "robot", "puzzle", "shell", "stone", "scarf", "spoon", "bell", "lamp", "key",
          "bag", "flag", "clock", "crayon", "map", "coin", "ring", "sock", "flute")

CHARACTERS_PER_STORY = 2


@dataclass(frozen=True)
class Template:
    """One sentence: words and {slot}s, as it is written (capitals and commas included).

    effect names what the sentence does to the story beyond its slots: "lose" marks the
    subject's thing as lost, "find" marks the lost thing as found.
    """

    text: str
    effect: str | None = None

    @property
    def items(self) -> tuple[str, ...]:
        """The sentence split like the tokenizer splits text: words, slots, punctuation."""
        return tuple(item if item.startswith("{") else item.lower()
                     for item in re.findall(r"\{\w+\}|\w+|[^\w\s]", self.text))


INTRODUCTION = (
    Template("Once upon a time, there was a {trait} {child} named {new_name}."),
    Template("There once was a {trait} {child} named {new_name}."),
    Template("Long ago, in a small village, there lived a {trait} {child} named {new_name}."),
)
FRIEND = (
    Template("{name} had a friend named {new_name}."),
    Template("One day, {name} met a {trait} {child} named {new_name}."),
    Template("{name} lived next to a {child} named {new_name}."),
)
THING = (
    Template("{name} had a {new_adjective} {new_thing}."),
    Template("{name} got a {new_adjective} {new_thing} from {his} {family}."),
)
SCENE = (
    Template("{name} and {other} went to the {place}."),
    Template("{name} played with {his} {own_adjective} {own_thing}."),
    Template("{name} showed {other} {his} {own_adjective} {own_thing}."),
    Template("{name} and {other} played with the {any_adjective} {any_thing}."),
    Template("{name} was {feeling}."),
    Template("It was a {weather} day."),
    Template("They saw a {animal} near the {place}."),
    Template("{name} told {other} about the {seen_animal}."),
    Template("{name} shared a {food} with {other}."),
    Template("{name} said hello to {other}."),
    Template("{name} asked {other} to play."),
)
SONG = (
    Template("{name} made up a song: {song_1} {song_2} {song_3} {song_4} {song_5} {song_6}."),
)
SINGING = (
    Template("{name} sang: {sung_1} {sung_2} {sung_3} {sung_4} {sung_5} {sung_6}."),
    Template("{name} and {other} sang the song: {sung_1} {sung_2} {sung_3} {sung_4} {sung_5} "
             "{sung_6}."),
)
PROBLEM = (
    Template("{name} lost {his} {own_adjective} {own_thing}.", effect="lose"),
    Template("{name} could not find {his} {own_adjective} {own_thing}.", effect="lose"),
)
SEARCH = (
    Template("{name} and {other} looked for the {lost_adjective} {lost_thing}."),
    Template("{name} looked under the {furniture}."),
    Template("{name} asked {other} to help."),
    Template("{name} was {feeling}."),
)
FOUND = (
    Template("{name} found the {lost_adjective} {lost_thing} under the {furniture}.",
             effect="find"),
    Template("At last, {name} found the {lost_adjective} {lost_thing} behind the {furniture}.",
             effect="find"),
)
THANKS = (
    Template("{name} said thank you to {other}."),
    Template("{name} gave the {any_adjective} {any_thing} back to {owner}."),
)
ENDING = (
    Template("{name} and {other} were happy."),
    Template("From that day on, {name} and {other} were best friends."),
    Template("{name} and {other} went home."),
)

PLOT = (
    # (sentences to choose from, fewest, most)
    (INTRODUCTION, 1, 1), (THING, 1, 1), (FRIEND, 1, 1), (THING, 1, 1), (SONG, 1, 1),
    (SCENE, 1, 2), (SINGING, 1, 1), (SCENE, 1, 2), (PROBLEM, 1, 1), (SEARCH, 1, 2),
    (SINGING, 1, 1), (FOUND, 1, 1), (THANKS, 1, 2), (SINGING, 1, 1), (ENDING, 1, 1),
)
"""The order a generated story follows; the checker accepts the sentences in any order."""

TEMPLATES = tuple(dict.fromkeys(t for group, _, _ in PLOT for t in group))
"""Every sentence of the grammar, each once."""

REPEATED_SLOTS = {
    "name": ("other", "owner"),
    "thing": ("own_thing", "any_thing", "lost_thing"),
    "song": tuple(f"sung_{i + 1}" for i in range(SONG_LENGTH)),
}
"""Slots whose word the story so far fixes, by kind: the other character or the thing's owner;
the noun that goes with an adjective; the sounds of the song, in order."""


@dataclass
class Thing:
    adjective: str
    noun: str
    owner: str
    lost: bool = False


@dataclass
class StoryState:
    """What the sentences so far have introduced: the only memory the grammar has."""

    genders: dict[str, str] = field(default_factory=dict)  # name -> "girl" or "boy"
    things: list[Thing] = field(default_factory=list)
    animals_seen: list[str] = field(default_factory=list)
    song: tuple[str, ...] = ()  # the words of the song made up, in order

    def thing(self, adjective: str) -> Thing | None:
        return next((t for t in self.things if t.adjective == adjective), None)


def _gender(name: str) -> str:
    return "girl" if name in GIRL_NAMES else "boy"


def allowed_words(slot: str, bound: dict[str, str], state: StoryState) -> tuple[str, ...]:
    """The words a slot accepts, given the slots already filled in this sentence (bound) and
    the story so far. An empty tuple means the sentence cannot be said here."""
    subject = bound.get("name")
    if slot in FREE_WORDS:
        return FREE_WORDS[slot]
    if slot == "new_name":
        if len(state.genders) >= CHARACTERS_PER_STORY:
            return ()
        names = GIRL_NAMES if bound.get("child") == "girl" else \
            BOY_NAMES if bound.get("child") == "boy" else GIRL_NAMES + BOY_NAMES
        return tuple(n for n in names if n not in state.genders)
    if slot == "name":
        return tuple(state.genders)
    if slot == "other":
        return tuple(n for n in state.genders if n != subject)
    if slot == "his":
        return ("her",) if state.genders.get(subject) == "girl" else ("his",)
    if slot == "new_adjective":
        if any(t.owner == subject for t in state.things):
            return ()
        return tuple(a for a in ADJECTIVES if state.thing(a) is None)
    if slot.startswith("song_"):  # a new song of words not yet in it
        return () if state.song else tuple(
            w for w in SONG_WORDS
            if w not in [bound.get(f"song_{i + 1}") for i in range(SONG_LENGTH)])
    if slot.startswith("sung_"):  # the song as it was made up
        index = int(slot[len("sung_"):]) - 1
        return state.song[index:index + 1]
    if slot in ("new_thing", "seen_animal"):
        return THINGS if slot == "new_thing" else tuple(state.animals_seen)
    adjective_rule = {
        "own_adjective": lambda t: t.owner == subject and not t.lost,
        "any_adjective": lambda t: not t.lost,
        "lost_adjective": lambda t: t.lost,
    }
    if slot in adjective_rule:
        return tuple(t.adjective for t in state.things if adjective_rule[slot](t))
    if slot in ("own_thing", "any_thing", "lost_thing"):
        thing = state.thing(bound.get(slot.replace("_thing", "_adjective"), ""))
        return (thing.noun,) if thing else ()
    if slot == "owner":
        thing = state.thing(bound.get("any_adjective", ""))
        return (thing.owner,) if thing and thing.owner != subject else ()
    raise KeyError(f"unknown slot {{{slot}}}")


def _apply(template: Template, bound: dict[str, str], state: StoryState) -> None:
    """Change the story state after a complete sentence."""
    if "new_name" in bound:
        state.genders[bound["new_name"]] = _gender(bound["new_name"])
    if "new_adjective" in bound:
        state.things.append(Thing(bound["new_adjective"], bound["new_thing"], bound["name"]))
    if "animal" in bound and bound["animal"] not in state.animals_seen:
        state.animals_seen.append(bound["animal"])
    if "song_1" in bound:
        state.song = tuple(bound[f"song_{i + 1}"] for i in range(SONG_LENGTH))
    if template.effect == "lose":
        state.thing(bound["own_adjective"]).lost = True
    if template.effect == "find":
        state.thing(bound["lost_adjective"]).lost = False


# --- generating ---------------------------------------------------------------------------

def _fill(template: Template, state: StoryState, rng: np.random.Generator) -> list[str] | None:
    """Words of one sentence with every slot filled at random; None if a slot has no word."""
    bound: dict[str, str] = {}
    words = []
    for item in template.items:
        if item.startswith("{"):
            slot = item[1:-1]
            options = allowed_words(slot, bound, state)
            if not options:
                return None
            bound[slot] = options[rng.integers(len(options))]
            item = bound[slot]
        words.append(item)
    _apply(template, bound, state)
    return words


def generate_story_words(rng: np.random.Generator) -> list[str]:
    """One story as a list of words and punctuation (vocabulary spelling, no BOS)."""
    state = StoryState()
    words: list[str] = []
    for group, fewest, most in PLOT:
        for _ in range(int(rng.integers(fewest, most + 1))):
            for _attempt in range(100):
                sentence = _fill(group[rng.integers(len(group))], state, rng)
                if sentence is not None:
                    break
            else:  # every sentence of the group is always sayable at its place in the plot
                raise RuntimeError(f"no sentence of {group} fits the story {words}")
            words += sentence
    return words


def generate_story(rng: np.random.Generator) -> str:
    """One story, as text (real_model): "Once upon a time, there was a shy girl named ..."."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("generate_story needs a numpy Generator, for example "
                        f"np.random.default_rng(0), got {type(rng).__name__}")
    return words_to_text(generate_story_words(rng))


MAX_STORIES = 100_000
"""More stories than any lesson or test asks for (minutes of generation): refused."""


def generate_stories(n: int, seed: int) -> list[str]:
    """n stories from one seeded generator: the same seed gives the same stories."""
    n, seed = as_whole_number("n", n, 0, MAX_STORIES), as_whole_number("seed", seed)
    rng = np.random.default_rng(seed)
    return [generate_story(rng) for _ in range(n)]


# --- text <-> words -----------------------------------------------------------------------

_TOKEN = re.compile(r"<bos>|\w+|[^\w\s]")
_STORY_BREAK = re.compile(r"\n[ \t]*\n")
_END = "."


def _vocabulary() -> tuple[str, ...]:
    words = [BOS, ".", ",", ":"]
    for template in TEMPLATES:
        words += [i for i in template.items if not i.startswith("{") and i.isalpha()]
    words += GIRL_NAMES + BOY_NAMES + ADJECTIVES + THINGS + SONG_WORDS
    for group in FREE_WORDS.values():
        words += group
    words += ("her", "his")
    return tuple(dict.fromkeys(words))


VOCABULARY = _vocabulary()
"""Every token of the grammar, in id order: BOS first, then punctuation, the templates' own
words, names, adjectives, things and the free word classes. Names keep their capital."""

_SPELLING = {word.lower(): word for word in VOCABULARY}


def text_to_words(text: str) -> list[str]:
    """Text -> words and punctuation in vocabulary spelling (case is ignored), with BOS in
    front of every story; stories are separated by a blank line. Unknown words are kept as
    they are, for the caller to report."""
    if not isinstance(text, str):
        raise TypeError(f"expected the text of a story as a string, got {type(text).__name__}")
    words: list[str] = []
    for story in _STORY_BREAK.split(text):
        found = [_SPELLING.get(w.lower(), w) for w in _TOKEN.findall(story)]
        words += found if found[:1] == [BOS] else [BOS, *found]
    return words


def words_to_text(words) -> str:
    """Words -> text: punctuation attached, sentences capitalized, a blank line where a
    story starts (BOS), and no BOS shown. Inverse of text_to_words."""
    words = list(words)
    if words[:1] == [BOS]:
        words = words[1:]
    stories, text, sentence_start = [], "", True
    for word in [*words, BOS]:
        if word == BOS:
            stories.append(text)
            text, sentence_start = "", True
            continue
        if sentence_start and word[:1].isalpha():
            word = word[0].upper() + word[1:]
            sentence_start = False
        separator = "" if not text or not word[:1].isalnum() else " "
        text += separator + word
        sentence_start = sentence_start or word == _END
    return "\n\n".join(stories)


# --- checking -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Match:
    """How far a template matched a sentence, and what it expected where it stopped."""

    template: Template
    length: int
    bound: dict
    slots: tuple  # the slot each matched word filled, None for the template's own words
    expected: tuple[str, ...] = ()


def _match(template: Template, sentence: list[str], state: StoryState) -> _Match:
    bound: dict[str, str] = {}
    slots = []
    for position, item in enumerate(template.items):
        options = (item,) if not item.startswith("{") else \
            allowed_words(item[1:-1], bound, state)
        if position == len(sentence) or sentence[position] not in options:
            return _Match(template, position, bound, tuple(slots), options)
        if item.startswith("{"):
            bound[item[1:-1]] = sentence[position]
        slots.append(item[1:-1] if item.startswith("{") else None)
    if len(sentence) > len(template.items):
        return _Match(template, len(template.items), bound, tuple(slots), ("(end)",))
    return _Match(template, len(sentence), bound, tuple(slots))


def _sentences(story: list[str]):
    start = 0
    for index, word in enumerate(story):
        if word == _END:
            yield story[start:index + 1]
            start = index + 1
    if start < len(story):
        yield story[start:]


def _stories(words: list[str]):
    """-> (index of the story's first word, its words), one per story: a story starts after
    each BOS, and at the beginning if the words do not start with BOS."""
    starts = [index + 1 for index, word in enumerate(words) if word == BOS]
    if words[:1] != [BOS]:
        starts.insert(0, 0)
    ends = [start - 1 for start in starts[1:]] + [len(words)]
    return [(start, words[start:end]) for start, end in zip(starts, ends)]


def _parse(words: list[str], allow_unfinished: bool):
    """Match every sentence: -> (slot of each word or None, error message or None)."""
    unknown = sorted({w for w in words if w not in _SPELLING.values()})
    if unknown:
        return [], f"unknown word(s) {unknown}: not in the story vocabulary"
    slots: list[str | None] = [None] * len(words)
    stories = list(_stories(words))
    for story_index, (start, story) in enumerate(stories):
        last_story = story_index == len(stories) - 1
        if not story and not last_story:
            return slots, f"story {story_index + 1} is empty: a BOS follows a BOS"
        state = StoryState()
        position = start
        for sentence in _sentences(story):
            finished = sentence[-1] == _END
            matches = [_match(t, sentence, state) for t in TEMPLATES]
            whole = [m for m in matches if m.length == len(sentence) and not m.expected]
            started = [m for m in matches if m.length == len(sentence)]
            if finished and whole:
                _apply(whole[0].template, whole[0].bound, state)
                slots[position:position + len(sentence)] = whole[0].slots
            elif not finished and last_story and allow_unfinished and started:
                slots[position:position + len(sentence)] = started[0].slots
            else:
                return slots, _diagnose(sentence, matches, story_index, finished, state)
            position += len(sentence)
    return slots, None


def _diagnose(sentence, matches, story_index, finished, state: StoryState) -> str:
    text = words_to_text(sentence)
    if not finished:
        return f"story {story_index + 1}: the sentence \"{text}\" does not end with a full stop"
    best = max(matches, key=lambda m: m.length)
    if best.length == 0 and sentence[0] in GIRL_NAMES + BOY_NAMES:
        return (f"story {story_index + 1}: \"{text}\" is about {sentence[0]}, but the story "
                f"has no such character (it has {sorted(state.genders) or 'none yet'})")
    if best.length == 0:
        return f"story {story_index + 1}: no sentence of the grammar starts like \"{text}\""
    # every sentence that starts like this one: what any of them allows next
    allowed = tuple(dict.fromkeys(w for m in matches if m.length == best.length
                                  for w in m.expected))
    expected = ", ".join(allowed[:8]) + (", ..." if len(allowed) > 8 else "")
    said = words_to_text(sentence[:best.length])
    got = sentence[best.length] if best.length < len(sentence) else "(end)"
    return (f"story {story_index + 1}: in \"{text}\", after \"{said}\" the grammar allows "
            f"{expected or 'nothing (no character or thing of this story fits here)'}, "
            f"not \"{got}\"")


def first_error(text: str, allow_unfinished: bool = False) -> str | None:
    """None if text is a sequence of sentences of the grammar, else what is wrong where.

    allow_unfinished=True accepts a last sentence that stops early (a continuation cut off
    after a fixed number of tokens), as long as it is the start of a grammatical sentence.
    """
    return _parse(text_to_words(text), as_flag("allow_unfinished", allow_unfinished))[1]


def is_grammatical(text: str, allow_unfinished: bool = False) -> bool:
    """True if every sentence of text fits the grammar and the story so far (real_model)."""
    return first_error(text, allow_unfinished) is None


# --- ground truth for the attention heads -------------------------------------------------

@dataclass(frozen=True)
class Repeat:
    """A position whose word the story forces to repeat an earlier one (what_the_heads_read).

    position: where the word is (its query, the one that predicts it, is position - 1);
    kind: "name" (the other character, a thing's owner), "thing" (the noun after its
    adjective) or "song" (a sound of the song, sung again);
    earlier: where the same word occurs before, in the same story;
    distractor: where the other words of its kind occur before, in the same story (the other
    character, the other thing, the song's other sounds): copying must not pick them.
    """

    position: int
    word: str
    kind: str
    earlier: tuple[int, ...]
    distractor: tuple[int, ...]

    @property
    def latest(self) -> int | None:
        """The most recent earlier word of the same kind (either list), or None: where the
        trained model's name head looks (what_the_heads_read)."""
        return max(self.earlier + self.distractor, default=None)


def slot_of_each_word(words) -> list[str | None]:
    """For a grammatical list of words, the slot each word fills: None for BOS and for the
    template's own words. Raises ValueError naming the first error otherwise."""
    slots, error = _parse(list(words), allow_unfinished=True)
    if error:
        raise ValueError(f"not a text of the grammar: {error}")
    return slots


def forced_repeats(words, kind: str) -> list[Repeat]:
    """Every position where the story forces a word of this kind to repeat an earlier one,
    with the earlier occurrences of that word and of its distractors, for the head tests.

    words: a grammatical list of words (from text_to_words, or a tokenizer's tokens).
    """
    kind = as_one_of("kind", kind, sorted(REPEATED_SLOTS))
    words = list(as_instance("words", words, (list, tuple), "text_to_words(text)"))
    if not all(isinstance(word, str) for word in words):
        raise TypeError(f"words must be words (str), as text_to_words gives, got {words!r:.80}")
    same_kind = {"name": GIRL_NAMES + BOY_NAMES, "thing": THINGS, "song": SONG_WORDS}[kind]
    repeats = []
    story_start = 0
    for position, (word, slot) in enumerate(zip(words, slot_of_each_word(words))):
        if word == BOS:
            story_start = position + 1
        if slot in REPEATED_SLOTS[kind]:
            before = range(story_start, position)
            repeats.append(Repeat(
                position, word, kind,
                earlier=tuple(j for j in before if words[j] == word),
                distractor=tuple(j for j in before if words[j] in same_kind and words[j] != word),
            ))
    return repeats
