"""Hypothesis strategies shared by the property tests: random models of every architecture
kvlib has, and prompts for them."""

from hypothesis import strategies as st

import kvlib


@st.composite
def configs(draw, *, latent=None, window=None, positions=None, context_length=40,
            dtype="float64", norm=None, rope_pairing=None):
    """A small random ModelConfig. latent / window: True forces the option, False forbids
    it, None lets hypothesis choose; positions, norm, rope_pairing: a value, or None for any."""
    kinds = ["plain", "window", "latent"]     # kvlib does not combine a window and a latent
    if latent is not None:
        kinds = [k for k in kinds if (k == "latent") == latent]
    if window is not None:
        kinds = [k for k in kinds if (k == "window") == window]
    kind = draw(st.sampled_from(kinds))
    use_latent, use_window = kind == "latent", kind == "window"
    scheme = positions or draw(st.sampled_from(kvlib.config.POSITION_SCHEMES))
    n_heads = draw(st.sampled_from([1, 2, 4, 6]))
    head_dim = draw(st.sampled_from([2, 4, 6] if scheme == "rotary" else [1, 2, 3, 4]))
    options = dict(
        vocab_size=draw(st.integers(2, 30)),
        d_model=n_heads * head_dim,
        n_heads=n_heads,
        n_layers=draw(st.integers(1, 3)),
        d_ff=draw(st.integers(1, 16)),
        context_length=context_length,
        dtype=dtype,
        positions=scheme,
        norm=norm or draw(st.sampled_from(kvlib.config.NORMS)),
        mlp=draw(st.sampled_from(kvlib.config.MLPS)),
        rope_pairing=rope_pairing or draw(st.sampled_from(kvlib.config.ROPE_PAIRINGS)),
    )
    if use_latent:
        options["latent_dim"] = draw(st.integers(1, 8))
        if scheme == "rotary":
            options["rope_head_dim"] = draw(st.sampled_from([2, 4]))
    else:
        options["bias"] = draw(st.booleans())
        divisors = [k for k in range(1, n_heads + 1) if n_heads % k == 0]
        options["n_kv_heads"] = draw(st.sampled_from([None, *divisors]))
    if use_window:
        options["window"] = draw(st.integers(1, 8))
        options["sink_tokens"] = draw(st.integers(0, 3))
    return kvlib.ModelConfig(**options)


@st.composite
def models(draw, **config_options):
    """(params, config) for a random config, with seeded random weights."""
    config = draw(configs(**config_options))
    return kvlib.init_params(config, seed=draw(st.integers(0, 10_000))), config


def token_lists(draw, config, min_size=1, max_size=12):
    return draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=min_size,
                         max_size=max_size))
