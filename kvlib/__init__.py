"""kvlib: a decoder-only language model and its KV cache in plain numpy, for teaching.

Each function's docstring names the notebook that introduces it and its shapes.
The core needs numpy only; kvlib.plots and kvlib.widgets import matplotlib and ipywidgets.
"""

from .cache import ConcatenatingKVCache, KVCache
from .config import GPT2_SMALL, ModelConfig
from .flops import (
    MultiplyAdds,
    count_multiply_adds,
    decode_step_multiply_adds,
    forward_multiply_adds,
    generation_multiply_adds,
    prefill_multiply_adds,
)
from .inference import (
    check_ids,
    choose_next_token,
    decode_step,
    forward,
    generate,
    next_token_probabilities,
    prefill,
)
from .memory import GiB, MiB, kv_cache_bytes
from .model import (
    apply_mask,
    attention,
    attention_scores,
    attention_weights,
    causal_mask,
    decoder_block,
    embed,
    gelu,
    merge_heads,
    mlp,
    output_projection,
    project_qkv,
    softmax,
    split_heads,
    unembed,
    weighted_sum,
)
from .params import DEFAULT_SEED, LayerParams, Params, init_params
from .tokenizer import BOS, TOY_VOCABULARY, ToyTokenizer

ARTICLE_PROMPT = "How are you?"
"""The worked example's prompt: ToyTokenizer().encode(ARTICLE_PROMPT) == [0, 3, 7, 1, 9]."""

__all__ = [name for name in dir() if not name.startswith("_")]
