"""Fewer K/V heads than query heads (grouped_query_attention): multi-query and grouped-query
attention.

With n_heads query heads and kv K/V heads, query head i reads K/V head i // (n_heads / kv):
the query heads form kv groups of consecutive heads, one group for each K/V head. kvlib's
attention (kvlib.model.attention_scores, weighted_sum) meets each group with its K/V head by
broadcasting, without copying the cache; this module holds the plain reference it is checked
against (the K/V heads repeated, as transformers' repeat_kv does) and the two conversions
between a grouped model and a multi-head one:

- duplicate_kv_heads: the multi-head model that computes exactly what a grouped one does
  (each K/V head copied to every query head of its group);
- mean_pool_kv_heads: the start of Ainslie et al.'s (2023) "uptraining" of a multi-head
  model into a grouped one, which averages the K/V projections within each group. It changes
  what the model computes unless the heads of a group were already equal, which is why the
  converted model is trained further.

Shapes: h query heads, kv K/V heads, group = h / kv, S positions, dh the head size,
d = d_model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .checks import as_array, as_mask, as_params, as_whole_number
from .config import ModelConfig
from .model import softmax
from .params import Params

MAX_HEADS = 1_000_000
"""More heads than any model has; a larger count is refused before numpy sees it."""


def group_size(n_heads: int, n_kv_heads: int) -> int:
    """Query heads that share one K/V head (grouped_query_attention): n_heads / n_kv_heads.

    Raises a ValueError that names the rule when n_kv_heads does not divide n_heads.
    """
    n_heads = as_whole_number("n_heads", n_heads, 1, MAX_HEADS)
    n_kv_heads = as_whole_number("n_kv_heads", n_kv_heads, 1, MAX_HEADS)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads "
                         f"({n_kv_heads}): each K/V head serves an equal group of query heads")
    return n_heads // n_kv_heads


def query_groups(n_heads: int, n_kv_heads: int) -> np.ndarray:
    """The K/V head each query head reads (grouped_query_attention): int array (h,), entry i = i //
    group.

    query_groups(8, 2) is [0 0 0 0 1 1 1 1]: heads 0-3 share K/V head 0, heads 4-7 K/V head 1.
    """
    group = group_size(n_heads, n_kv_heads)          # checks both before numpy sees them
    return np.arange(n_heads) // group


def repeat_kv_heads(K: np.ndarray, n_heads: int) -> np.ndarray:
    """Lend each K/V head to its group (grouped_query_attention): K (kv, S, dh) -> (h, S, dh), a
    copy.

    Head i of the result is K/V head i // group: np.repeat along the head axis, the order of
    transformers' repeat_kv (np.tile would give the order 0, 1, 0, 1, ...: the wrong pairs).
    Attention on the result equals kvlib's grouped attention, which reads the kv heads
    without making these group - 1 extra copies of each.
    """
    K = as_array("K", K, 3)
    return np.repeat(K, group_size(n_heads, K.shape[0]), axis=0)


def repeated_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray,
                       mask: np.ndarray | None = None) -> np.ndarray:
    """Grouped attention written the plain way (grouped_query_attention), the reference
    kvlib.attention is checked against: Q (h, T, dh), K and V (kv, S, dh) -> (h, T, dh).

    The K/V heads are repeated to h heads, then every query head does ordinary attention.
    """
    Q = as_array("Q", Q, 3)
    n_heads, _, head_dim = Q.shape
    K_all, V_all = repeat_kv_heads(K, n_heads), repeat_kv_heads(V, n_heads)
    if K_all.shape[-1] != head_dim or V_all.shape[1] != K_all.shape[1]:
        raise ValueError(f"Q {Q.shape}, K {K.shape} and V {V.shape} must have one head size "
                         "and K and V one number of positions")
    scores = Q @ K_all.swapaxes(-1, -2) / float(np.sqrt(head_dim))
    if mask is not None:
        scores = np.where(as_mask(mask, scores.shape[-2:]), scores, -np.inf)
    return softmax(scores) @ V_all


# ----------------------------------------------------------------------------- models

def _head_blocks(W: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """A K or V projection (d, kv x dh) or its bias (kv x dh,) as (..., kv, dh)."""
    return W.reshape(*W.shape[:-1], n_kv_heads, W.shape[-1] // n_kv_heads)


def _with_kv_projections(params: Params, config: ModelConfig, change) -> Params:
    layers = []
    for layer in params.layers:
        names = ("Wk", "Wv") + (("bk", "bv") if layer.bk is not None else ())
        layers.append(dataclasses.replace(layer, **{name: change(getattr(layer, name))
                                                    for name in names}))
    return Params(config, params.embedding, tuple(layers), params.position_table,
                  params.ln_f_gain, params.ln_f_bias)


def duplicate_kv_heads(params: Params) -> Params:
    """The multi-head model that computes what a grouped one does (grouped_query_attention).

    Each K/V head's columns of Wk and Wv (and of bk, bv) are copied to every query head of
    its group, so Wk and Wv grow from (d, kv x dh) to (d, d). Its logits equal the grouped
    model's; its cache holds every K/V head `group` times, h / kv times the bytes.
    """
    config = as_params(params).config
    if config.latent_dim is not None:
        raise ValueError("latent attention (the latent_attention lesson) caches a latent, not "
                         "K/V heads: there are none to copy or pool")
    group = config.n_heads // config.kv_heads

    def widen(W):
        copies = np.repeat(_head_blocks(W, config.kv_heads), group, axis=-2)
        return copies.reshape(*W.shape[:-1], config.d_model)

    return _with_kv_projections(params, config.replace(n_kv_heads=None), widen)


def mean_pool_kv_heads(params: Params, n_kv_heads: int) -> Params:
    """A model with n_kv_heads K/V heads made from one with more (grouped_query_attention): the K
    and V projections (and biases) of the heads that will share a K/V head are averaged.

    This is how Ainslie et al. (2023) start turning a trained multi-head checkpoint into a
    grouped-query one; they then train it further ("uptraining", about 5% of the original
    training compute). Pooling alone changes what the model computes unless the pooled heads
    were equal. The new group of query head i is i // (h / n_kv_heads), as in query_groups.
    """
    config = as_params(params).config
    if config.latent_dim is not None:
        raise ValueError("latent attention (the latent_attention lesson) caches a latent, not "
                         "K/V heads: there are none to copy or pool")
    n_kv_heads = as_whole_number("n_kv_heads", n_kv_heads, 1, MAX_HEADS)
    if config.kv_heads % n_kv_heads:
        raise ValueError(f"the model has {config.kv_heads} K/V heads: pooling averages equal "
                         f"groups of them, so n_kv_heads must divide {config.kv_heads}, got "
                         f"{n_kv_heads}")
    pooled = config.kv_heads // n_kv_heads
    new_config = config.replace(n_kv_heads=None if n_kv_heads == config.n_heads else n_kv_heads)

    def pool(W):
        heads = _head_blocks(W, config.kv_heads)                        # (..., kv, dh)
        groups = heads.reshape(*W.shape[:-1], n_kv_heads, pooled, heads.shape[-1])
        return groups.mean(axis=-2).reshape(*W.shape[:-1], n_kv_heads * heads.shape[-1])

    return _with_kv_projections(params, new_config, pool)


__all__ = ["duplicate_kv_heads", "group_size", "mean_pool_kv_heads",
           "query_groups", "repeat_kv_heads", "repeated_attention"]
