"""Keys with outlier channels (quantized_cache): the same model, with a few key channels made
larger and the query columns that meet them smaller, as in large trained models' keys.
"""

from __future__ import annotations

import dataclasses
from numbers import Integral

import numpy as np

from ...checks import as_real_number, as_whole_numbers
from ...params import Params


def with_outlier_key_channels(params: Params, channels, factor: float, layers=None) -> Params:
    """The same model with outlier key channels (quantized_cache): in each of the given layers
    (all by default), key channels `channels` (columns of K, 0 .. kv_width - 1) multiplied
    by factor, and the query columns that meet them divided by it.

    Every score q . k = sum over c of q_c k_c is unchanged, so the model computes the same
    logits; only the cached keys look different: a few of their channels are factor times
    larger, as in the keys of large trained models (KIVI). With fewer K/V heads, a key
    channel meets one query column in each head of its group. Needs learned or no positions
    (rotary positions turn pairs of channels together) and K and V (not a latent).
    """
    if not isinstance(params, Params) or params.config.latent_dim is not None or \
            params.config.positions == "rotary":
        raise ValueError("with_outlier_key_channels needs kvlib Params of a model with K and V "
                         "and learned or no positions: rotary positions turn pairs of channels "
                         "together, and a latent has no key channels")
    config, factor = params.config, as_real_number("factor", factor, positive=True)
    channels = np.unique(as_whole_numbers("channels", np.atleast_1d(channels)
                                       if isinstance(channels, Integral) else channels))
    layers = set(as_whole_numbers("layers", range(config.n_layers) if layers is None else
                               list(layers) if isinstance(layers, (set, range)) else layers))
    if not channels.size or channels.max() >= config.kv_width or \
            max(layers, default=0) >= config.n_layers:
        raise ValueError(f"channels must be between 0 and {config.kv_width - 1} (at least one), "
                         f"layers between 0 and {config.n_layers - 1}")
    dh, group = config.head_dim, config.n_heads // config.kv_heads
    # key channel g*dh + i meets query column h*dh + i of every head h in K/V head g's group
    queries = np.array([(c // dh * group + member) * dh + c % dh
                        for c in channels for member in range(group)])
    new_layers = []
    for index, layer in enumerate(params.layers):
        if index not in layers:
            new_layers.append(layer)
            continue
        changed = {}
        for name, columns, by in (("Wk", channels, factor), ("bk", channels, factor),
                                  ("Wq", queries, 1 / factor), ("bq", queries, 1 / factor)):
            array = getattr(layer, name)
            if array is None:
                continue
            array = array.copy()
            array[..., columns] = array[..., columns] * array.dtype.type(by)
            changed[name] = array
        new_layers.append(dataclasses.replace(layer, **changed))
    return Params(config, params.embedding, tuple(new_layers), params.position_table,
                  params.ln_f_gain, params.ln_f_bias)
