"""What attention heads read, measured from recorded weights (what_the_heads_read): how much
each head puts on the previous token, on the token after an earlier occurrence of the current
one (an induction head), on given positions, and how far back a head reads.

recorded is what `record_attention` collects in a forward pass: one (h, T, T) array per layer.
numpy only; the lesson draws the results (kvlib.widgets.what_the_heads_read).
"""

from __future__ import annotations

import numpy as np

from .checks import as_array, as_matrix, as_whole_number, as_whole_numbers


def _stacked(recorded) -> np.ndarray:
    """recorded, one (h, T, S) array per layer, as one (L, h, T, S) array."""
    if isinstance(recorded, np.ndarray) and recorded.ndim == 4:
        return as_array("recorded", recorded, 4)
    if not isinstance(recorded, (list, tuple)) or not recorded:
        raise TypeError(f"recorded must be a list of one (h, T, T) array per layer "
                        f"(record_attention), got {type(recorded).__name__}")
    layers = [as_array(f"recorded[{i}]", w, 3) for i, w in enumerate(recorded)]
    if len({w.shape for w in layers}) > 1:
        raise ValueError(f"recorded's layers differ in shape: {[w.shape for w in layers]}")
    return np.stack(layers)


def previous_token_scores(recorded) -> np.ndarray:
    """For every layer and head, the mean weight a query puts on the position just before it
    (what_the_heads_read): recorded = one (h, T, T) array per layer (record_attention of a forward
    pass over T >= 2 tokens) -> (L, h). 1 is a perfect previous-token head."""
    weights = _stacked(recorded)                                   # (L, h, T, T)
    T = weights.shape[-1]
    if T < 2:
        raise ValueError("a previous-token score needs at least 2 tokens")
    return weights[..., np.arange(1, T), np.arange(T - 1)].mean(axis=-1)


def weight_on(recorded, query: int, keys) -> np.ndarray:
    """For every layer and head, the weight the query at position `query` puts on the
    positions `keys`, added up (what_the_heads_read): -> (L, h)."""
    weights = _stacked(recorded)                                   # (L, h, T, S)
    query = as_whole_number("query", query, 0, weights.shape[2] - 1)
    keys = as_whole_numbers("keys", keys)
    if keys.size and keys.max() >= weights.shape[3]:
        raise ValueError(f"keys must be positions below {weights.shape[3]}, got {keys.tolist()}")
    return weights[:, :, query, keys].sum(axis=-1)


def forced_name_weights(recorded, repeats) -> dict[str, np.ndarray]:
    """Where a story forces a name (kvlib.stories.forced_repeats(words, "name")): for every
    layer and head, the mean weight the query before the name (r.position - 1) puts on the
    latest name of either character (r.latest), on the earlier occurrences of the name that
    comes next (r.earlier) and on the other character's (r.distractor) (what_the_heads_read).

    recorded: one (h, T, T) array per layer (record_attention of a forward over the story);
    -> {"latest", "earlier", "distractor"}: (L, h) each.
    """
    weights = _stacked(recorded)                                   # (L, h, T, T)
    if not isinstance(repeats, (list, tuple)) or not all(hasattr(r, "latest") for r in repeats):
        raise TypeError(f"repeats must be the list kvlib.stories.forced_repeats(words, 'name') "
                        f"gives, got {type(repeats).__name__}")
    repeats = [r for r in repeats if r.latest is not None]
    if not repeats:
        raise ValueError("no forced name with an earlier name before it: nothing to measure")
    rows = [weights[:, :, r.position - 1] for r in repeats]        # (L, h, T) each
    return {
        "latest": np.mean([row[..., r.latest] for row, r in zip(rows, repeats)], axis=0),
        "earlier": np.mean([row[..., list(r.earlier)].sum(-1) for row, r in zip(rows, repeats)],
                           axis=0),
        "distractor": np.mean([row[..., list(r.distractor)].sum(-1)
                               for row, r in zip(rows, repeats)], axis=0),
    }


def induction_scores(recorded, half: int) -> np.ndarray:
    """For a text made of one piece of `half` tokens said twice: for every layer and head, the
    mean weight a query in the second copy (at half + i) puts on the token that followed its
    own token in the first copy (at i + 1), over i = 0 .. half - 2 (what_the_heads_read): -> (L, h).
    An induction head, the mechanism that lets a model copy what it has read, scores near 1."""
    weights = _stacked(recorded)                                   # (L, h, 2 half, 2 half)
    half = as_whole_number("half", half, 2)
    if weights.shape[-1] != 2 * half:
        raise ValueError(f"induction scores need a text of twice {half} >= 2 tokens, got "
                         f"{weights.shape[-1]} positions")
    i = np.arange(half - 1)
    return weights[..., half + i, i + 1].mean(axis=-1)


def copied_fraction(logits, ids, half: int) -> float:
    """Share of the second copy's tokens (after its first) the model predicted greedily from
    the position before them (what_the_heads_read): logits (2 half, V) of a text said twice."""
    logits, ids = as_matrix("logits", logits), as_whole_numbers("ids", ids)
    half = as_whole_number("half", half, 2)
    if not len(logits) == len(ids) == 2 * half:
        raise ValueError(f"need logits and ids of a text of twice {half} tokens, got "
                         f"{len(logits)} rows of logits and {len(ids)} ids")
    predicted = np.argmax(logits[half:-1], axis=-1)
    return float(np.mean(predicted == ids[half + 1:]))


def best_head(scores: np.ndarray) -> tuple[int, int]:
    """(layer, head) of the largest score in an (L, h) table."""
    scores = as_matrix("scores", scores)
    if scores.size == 0:
        raise ValueError("scores is empty: need an (L, h) table with at least one head")
    layer, head = np.unravel_index(int(np.argmax(scores)), scores.shape)
    return int(layer), int(head)


def distances_read(weights, queries) -> np.ndarray:
    """How far back one head reads (what_the_heads_read): weights (T, T) of one head, queries =
    positions -> (len(queries),) ints, each query minus the position it puts the most
    weight on (0 when that is the query itself). A cache, or a sliding window, must still
    hold that position when the query is decoded."""
    weights = as_array("weights", weights)
    if weights.ndim != 2 or weights.shape[0] != weights.shape[1]:
        raise ValueError(f"need one head's (T, T) attention weights, got shape {weights.shape}")
    queries = as_whole_numbers("queries", queries)
    T = weights.shape[0]
    if queries.size and not (0 <= queries.min() and queries.max() < T):
        raise ValueError(f"queries must be positions 0 .. {T - 1}, got {queries.tolist()}")
    # a causal head puts nothing after the query; argmax over 0 .. q keeps that explicit
    return np.array([q - int(np.argmax(weights[q, :q + 1])) for q in queries], dtype=int)
