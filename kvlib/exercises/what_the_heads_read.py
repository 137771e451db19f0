"""Exercises of the what_the_heads_read lesson (what the heads read): checkers and solutions.

Exercise 1 finds, on the trained story model and another story of its grammar, the head that
decides a forced name: the one that looks at the latest name (the other character's), so
that the model answers by elimination
(exercise 3 of the real_model lesson before the lesson was split in two, unchanged). Exercise 2
measures how far back the song's copy head reads on that story, and turns it into the smallest
sliding window (sliding_windows_and_sinks) that would still hold it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import Feedback, checker, read_whole_number, read_whole_numbers, show_solution

# Exercise 1 ------------------------------------------------------------------------------

EXERCISE_SEED = 12
"""The seed of the exercise's story: kvlib.stories.generate_story(np.random.default_rng(12))."""


@lru_cache(maxsize=1)
def story_model():
    """(params in float64, tokenizer) of the trained story model, made once."""
    from kvlib import stories

    return stories.load_model(dtype="float64"), stories.load_tokenizer()


def exercise_story() -> str:
    """Another story of the grammar than the notebook's, always the same (seeded)."""
    from kvlib import stories

    return stories.generate_story(np.random.default_rng(EXERCISE_SEED))


def name_head_scores() -> dict[str, np.ndarray]:
    """On the exercise's story, per layer and head (L, h), from the query before each forced
    name: the weight on the latest name of either character ("latest", what decides the
    name), on the earlier occurrences of the name that comes next ("earlier"), on the other
    character's ("distractor"); and the mean weight of every query on the previous token
    ("previous"). The arrays are shared and read-only."""
    return dict(_name_head_scores())


@lru_cache(maxsize=1)
def _name_head_scores() -> dict[str, np.ndarray]:
    from kvlib import stories
    from kvlib.heads import forced_name_weights, previous_token_scores

    params, tokenizer = story_model()
    ids = tokenizer.encode(exercise_story())
    recorded = []
    kvlib.forward(params, ids, record_attention=recorded)
    repeats = stories.forced_repeats(tokenizer.tokens(ids), "name")
    scores = forced_name_weights(recorded, repeats)
    scores["previous"] = previous_token_scores(recorded)
    for table in scores.values():
        table.setflags(write=False)             # made once, shared by every call
    return scores


def _argmax(scores: np.ndarray) -> tuple[int, int]:
    layer, head = np.unravel_index(int(np.argmax(scores)), scores.shape)
    return int(layer), int(head)


@checker
def check_name_head(answer) -> Feedback:
    """Exercise 1: (layer, head), counted from 0, of the head that decides a forced name: the
    one with the most weight on the latest name (Repeat.latest) from the query before each
    forced name of the exercise's story."""
    chosen = read_whole_numbers(answer, 2, "answer")
    if isinstance(chosen, Feedback):
        return chosen
    scores = name_head_scores()
    latest = scores["latest"]
    n_layers, n_heads = latest.shape
    best = _argmax(latest)
    layer, head = chosen
    if chosen == best:
        message = (f"layer {layer}, head {head}: from the word before each forced name it puts "
                   f"{latest[best]:.2f} of its weight on the latest name, and that name is the "
                   f"other character's ({scores['distractor'][best]:.2f} on the other "
                   f"character, {scores['earlier'][best]:.2f} on the name that comes next). The "
                   "model writes the name this head did not see: it answers by elimination.")
        if _argmax(scores["previous"]) == best:
            message += (f" It is also the head with the most weight on the previous token, "
                        f"only {scores['previous'][best]:.2f}: no head of this model is a "
                        "previous-token head.")
        return Feedback(True, message)
    if (layer - 1, head - 1) == best:
        return Feedback(False, f"({layer}, {head}) counts from 1: Python's layers and heads "
                        f"count from 0, so the head you found is ({layer - 1}, {head - 1}).")
    if (head, layer) == best:
        return Feedback(False, f"layer and head swapped: you found layer {head}, head {layer}; "
                        "write answer = (layer, head).")
    if not (0 <= layer < n_layers and 0 <= head < n_heads):
        return Feedback(False, f"there is no layer {layer}, head {head}: the model has layers "
                        f"0 to {n_layers - 1} and heads 0 to {n_heads - 1}.")
    if chosen == _argmax(scores["earlier"]):
        return Feedback(False, f"layer {layer}, head {head} has the most weight on the earlier "
                        "occurrences of the name that comes next (r.earlier), but only "
                        f"{scores['earlier'][chosen]:.2f}: no head copies the right name. Score "
                        "each head by its weight on the latest name, r.latest, instead.")
    if chosen == _argmax(scores["previous"]):
        return Feedback(False, f"layer {layer}, head {head} has the most weight on the previous "
                        f"token ({scores['previous'][chosen]:.2f}), which is not what decides a "
                        "name. Score each head by its weight on r.latest from the query "
                        "r.position - 1.")
    return Feedback(False, f"layer {layer}, head {head} puts {latest[chosen]:.2f} of its weight "
                    "on the latest name, from the word before a forced name; another head puts "
                    f"{latest[best] - latest[chosen]:.2f} more. Average, over the forced names, "
                    "the weight from the query r.position - 1 on r.latest, for every layer and "
                    "head, and take the largest.")


# Exercise 2 ------------------------------------------------------------------------------

COPY_HEAD = (2, 0)
"""(layer, head) of the song's copy head, counted from 0: song_copy_head in
kvlib/models/stories/measured.json, and what the what_the_heads_read lesson measures."""
NAME_HEAD = (1, 3)
"""(layer, head) of the head that decides a name: latest_name_head in measured.json."""


def copy_head_reach() -> dict[str, np.ndarray]:
    """On the exercise's story, from the query before each repeated song sound (r.position - 1
    of stories.forced_repeats(words, "song")), how many positions back: "read", the position
    the copy head puts the most weight on; "nearest", where that sound was last sung; and,
    from the query before each forced name, "name", the position the name head reads most.
    The arrays are shared and read-only."""
    return dict(_copy_head_reach())


@lru_cache(maxsize=1)
def _copy_head_reach() -> dict[str, np.ndarray]:
    from kvlib import stories
    from kvlib.heads import distances_read

    params, tokenizer = story_model()
    ids = tokenizer.encode(exercise_story())
    words = tokenizer.tokens(ids)
    recorded = []
    kvlib.forward(params, ids, record_attention=recorded)
    songs = stories.forced_repeats(words, "song")
    names = stories.forced_repeats(words, "name")
    reach = {
        "read": distances_read(recorded[COPY_HEAD[0]][COPY_HEAD[1]],
                               [r.position - 1 for r in songs]),
        "nearest": np.array([r.position - 1 - max(r.earlier) for r in songs]),
        "name": distances_read(recorded[NAME_HEAD[0]][NAME_HEAD[1]],
                               [r.position - 1 for r in names]),
        "story": np.array([len(ids)]),
    }
    for array in reach.values():
        array.setflags(write=False)             # made once, shared by every call
    return reach


def copy_window() -> int:
    """The answer: the farthest position the copy head reads, plus the query itself."""
    return int(copy_head_reach()["read"].max()) + 1


@checker
def check_copy_window(answer) -> Feedback:
    """Exercise 2: the smallest sliding window W (the query and the W - 1 positions before
    it, the sliding_windows_and_sinks lesson) that still holds every position the copy head reads
    most, from the query before each repeated song sound of the exercise's story."""
    value = read_whole_number(answer, "a window size, in positions")
    if isinstance(value, Feedback):
        return value
    reach = copy_head_reach()
    read, nearest, name = reach["read"], reach["nearest"], reach["name"]
    farthest = int(read.max())
    right = farthest + 1
    if value == right:
        return Feedback(True, f"W = {right}. Each time the song is sung again, the copy head "
                        "reads every sound from where the song was made up: at the last singing "
                        f"that is {farthest} positions back, though each sound had been sung at "
                        f"most {int(nearest.max())} positions before (the head skips that). A "
                        f"window of {right - 1} would drop it; the name head would make do with "
                        f"{int(name.max()) + 1}. The copy head is why the cache keeps every "
                        "position.")
    if value == farthest:
        return Feedback(False, f"{value} is the farthest distance itself, one short: a window "
                        "of W holds the query and the W - 1 positions before it, so a position "
                        "D back needs W = D + 1.")
    if value in (int(nearest.max()), int(nearest.max()) + 1):
        return Feedback(False, f"{value} would keep the place where each sound was last sung "
                        "(the largest of r.earlier). The copy head does not read there: take "
                        "the position with the most weight in its row, np.argmax, and measure "
                        "how far back that is.")
    typical = {int(np.median(read)), int(np.median(read)) + 1, int(round(read.mean())),
               int(round(read.mean())) + 1}
    if value in typical:
        return Feedback(False, f"{value} fits a typical distance (the median is "
                        f"{np.median(read):.0f}, the mean {read.mean():.1f}), not every one: a "
                        "window must keep the farthest position any query reads. Take the "
                        "largest distance.")
    if value in (int(read.min()), int(read.min()) + 1):
        return Feedback(False, f"{value} keeps what the copy head reads the first time the song "
                        f"is sung again ({int(read.min())} back), but later singings read "
                        "farther: the window must keep the farthest position of all.")
    if value in (int(name.max()), int(name.max()) + 1):
        return Feedback(False, f"{value} is what the name head (layer {NAME_HEAD[0]}, head "
                        f"{NAME_HEAD[1]}) needs; the exercise asks for the song's copy head, "
                        f"layer {COPY_HEAD[0]}, head {COPY_HEAD[1]}, from the query before each "
                        "repeated sound.")
    if value < 1:
        return Feedback(False, f"{value}: a window holds at least the query itself, so W is "
                        "1 or more.")
    if value >= int(reach["story"][0]):
        return Feedback(False, f"a window of {value} keeps the whole story "
                        f"({int(reach['story'][0])} tokens), so nothing is lost, but it is not "
                        "the smallest that keeps what the copy head reads.")
    if value > right:
        return Feedback(False, f"a window of {value} keeps every position the copy head reads, "
                        "but so does a smaller one: the exercise asks for the smallest window "
                        "that still does.")
    return Feedback(False, f"{value} is not it. For each repeated sound r, take the copy head's "
                    "row at the query r.position - 1, find the position with the most weight "
                    "and how far back it is; the window must hold the farthest one and the "
                    "query itself.")


# Solutions -------------------------------------------------------------------------------

SOLUTIONS = {
    1: """
recorded = []
kvlib.forward(story, exercise_ids, record_attention=recorded)   # one (h, T, T) a layer
weights = np.stack(recorded)                                     # (layers, heads, T, T)
scores = np.mean([weights[:, :, r.position - 1, r.latest] for r in exercise_repeats],
                 axis=0)                                         # (layers, heads)
answer = heads.best_head(scores)                                 # (1, 3)
""",
    2: """
recorded = []
kvlib.forward(story, exercise_ids, record_attention=recorded)    # one (h, T, T) a layer
copy_weights = recorded[2][0]                                     # (T, T): layer 2, head 0
queries = [r.position - 1 for r in exercise_songs]                # before each repeated sound
distances = heads.distances_read(copy_weights, queries)          # positions back
answer = int(distances.max()) + 1                                 # and the query itself: 89
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
