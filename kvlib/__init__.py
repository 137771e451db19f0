"""kvlib: a decoder-only language model and its KV cache in plain numpy, for teaching.

Each function's docstring names the notebook that introduces it and its shapes.
The core needs numpy only; kvlib.plots and kvlib.widgets import matplotlib and ipywidgets.
"""

from . import eviction, long_context
from .bpe import Tokenizer
from .cache import (
    BaseKVCache,
    ConcatenatingKVCache,
    KVCache,
    LatentKVCache,
    SlidingWindowCache,
    make_cache,
)
from .checkpoints.gemma3 import GEMMA3_270M, gemma3_tokenizer, load_gemma3
from .checkpoints.smollm2 import SMOLLM2_135M, load_smollm2, smollm2_tokenizer
from .config import GPT2_LONG, GPT2_SMALL, ModelConfig
from .eviction import EvictingCache, pyramid_budgets
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
    next_token_losses,
    next_token_probabilities,
    prefill,
)
from .latent import latent_decoder_block
from .memory import (
    GiB,
    MiB,
    config_cache_bytes,
    kv_cache_bytes,
    latent_cache_bytes,
    local_global_cache_bytes,
)
from .model import (
    apply_mask,
    attention,
    attention_mask,
    attention_scores,
    attention_weights,
    causal_mask,
    decoder_block,
    embed,
    gelu,
    gelu_mlp,
    layer_norm,
    merge_heads,
    mlp,
    normalize,
    output_projection,
    project_qkv,
    rms_norm,
    silu,
    softmax,
    split_heads,
    swiglu_mlp,
    unembed,
    weighted_sum,
)
from .params import DEFAULT_SEED, LatentLayerParams, LayerParams, Params, init_params
from .positions import (
    RotaryPositions,
    add_positions,
    rotary_angles,
    rotary_positions,
    rotate_halves,
    rotate_pairs,
)
from .roofline import one_blas_thread_unless_set as _one_blas_thread_unless_set
from .tokenizer import BOS, TOY_VOCABULARY, ToyTokenizer

ARTICLE_PROMPT = "How are you?"
"""The worked example's prompt: ToyTokenizer().encode(ARTICLE_PROMPT) == [0, 3, 7, 1, 9]."""

_one_blas_thread_unless_set()     # a busy machine runs the lessons faster on one BLAS thread

__all__ = [name for name in dir() if not name.startswith("_")]
