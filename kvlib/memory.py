"""How much memory the KV cache takes (kv_cache_memory): the formula, the weights beside it, and
the published shapes of a few real models."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .checks import as_config, as_sizes, as_whole_number
from .config import attention_kind

GiB = 2**30
MiB = 2**20


def kv_cache_bytes(n_layers: int, d_model: int | None, seq_len: int, batch_size: int = 1,
                   dtype_bytes: int = 2, *, n_kv_heads: int | None = None,
                   head_dim: int | None = None) -> int:
    """Bytes of a KV cache: 2 (K and V) x batch x seq_len x width x dtype_bytes x n_layers.

    The width of the cached rows is d_model for multi-head attention. Models with fewer K/V
    heads than query heads (multi-query, grouped-query attention) cache n_kv_heads x head_dim
    instead: give both, and d_model may be None.

    >>> kv_cache_bytes(n_layers=80, d_model=8192, seq_len=4096) / GiB   # BF16, batch 1
    10.0
    """
    if (n_kv_heads is None) != (head_dim is None):
        raise ValueError("give both n_kv_heads and head_dim, or neither")
    if n_kv_heads is None:
        if d_model is None:
            raise ValueError("give d_model, or n_kv_heads and head_dim")
        width = as_whole_number("d_model", d_model)
    else:
        width = math.prod(as_sizes(1, n_kv_heads=n_kv_heads, head_dim=head_dim))
    return 2 * width * math.prod(as_sizes(batch_size=batch_size, seq_len=seq_len,
                                          dtype_bytes=dtype_bytes, n_layers=n_layers))


def latent_cache_bytes(n_layers: int, latent_dim: int, rope_head_dim: int, seq_len: int,
                       batch_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of a multi-head latent attention cache (latent_attention): batch x seq_len x
    (latent_dim + rope_head_dim) x dtype_bytes x n_layers. No factor 2: the one latent
    serves as keys and as values.

    >>> latent_cache_bytes(n_layers=61, latent_dim=512, rope_head_dim=64, seq_len=1)  # V3
    70272
    """
    width = as_whole_number("latent_dim", latent_dim, 1) + as_whole_number("rope_head_dim",
                                                                            rope_head_dim)
    return width * math.prod(as_sizes(batch_size=batch_size, seq_len=seq_len,
                                      dtype_bytes=dtype_bytes, n_layers=n_layers))


def config_cache_bytes(config, seq_len: int, batch_size: int = 1,
                       dtype_bytes: int | None = None) -> int:
    """Bytes of the cache a kvlib model holds after seq_len positions
    (kv_cache_memory to sliding_windows_and_sinks): kv_cache_bytes or latent_cache_bytes for its
    shapes, over the positions it holds (with a sliding window, the sinks and the last W).
    dtype_bytes defaults to the model's own. Equal to ``cache.nbytes`` of a live cache of that
    config."""
    config = as_config(config)
    dtype_bytes = config.numpy_dtype.itemsize if dtype_bytes is None else dtype_bytes
    held = config.held_positions(as_whole_number("seq_len", seq_len))
    if config.latent_dim is not None:
        return latent_cache_bytes(config.n_layers, config.latent_dim, config.rope_head_dim,
                                  held, batch_size, dtype_bytes)
    return kv_cache_bytes(config.n_layers, None, held, batch_size, dtype_bytes,
                          n_kv_heads=config.kv_heads, head_dim=config.head_dim)


def local_global_cache_bytes(layer_windows, seq_len: int, n_kv_heads: int, head_dim: int,
                             batch_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of the cache of a model whose layers mix sliding windows and global attention
    (local_and_global_layers): a layer with a window W holds min(seq_len, W) positions, a
    global layer (None) all seq_len; each position 2 (K and V) x n_kv_heads x head_dim x
    dtype_bytes. layer_windows: one entry a layer, W or None (Gemma3Config.layer_windows).

    >>> gemma3_270m = [None if (layer + 1) % 6 == 0 else 512 for layer in range(18)]
    >>> local_global_cache_bytes(gemma3_270m, 32768, n_kv_heads=1, head_dim=256) / MiB
    103.5
    """
    windows = list(layer_windows) if isinstance(layer_windows, (list, tuple)) else None
    if not windows or any(w is not None and (isinstance(w, bool) or not isinstance(w, int)
                                              or w < 1) for w in windows):
        raise ValueError(f"layer_windows must be a non-empty list with, for each layer, a "
                         f"window (a whole number >= 1) or None (global), got {layer_windows!r}")
    seq_len = as_whole_number("seq_len", seq_len)
    held = sum(seq_len if window is None else min(seq_len, window) for window in windows)
    return kv_cache_bytes(1, None, held, batch_size, dtype_bytes, n_kv_heads=n_kv_heads,
                          head_dim=head_dim)


def weights_bytes(n_parameters: int, dtype_bytes: int = 2) -> int:
    """Bytes of a model's weights (kv_cache_memory): n_parameters x dtype_bytes."""
    return math.prod(as_sizes(n_parameters=n_parameters, dtype_bytes=dtype_bytes))


def tokens_that_fit(memory_bytes: int, weights: int, bytes_per_token: int) -> int:
    """How many cached tokens fit beside the weights in an accelerator's memory (kv_cache_memory).

    (memory_bytes - weights) // bytes_per_token, summed over every sequence of a batch; 0 when
    the weights alone do not fit. bytes_per_token is a whole sequence position: K and V of
    every layer.
    """
    memory_bytes, weights = as_sizes(memory_bytes=memory_bytes, weights=weights)
    bytes_per_token = as_whole_number("bytes_per_token", bytes_per_token, 1)
    return max(memory_bytes - weights, 0) // bytes_per_token


@dataclass(frozen=True)
class ModelPreset:
    """The published shapes of a real model that set the size of its KV cache (kv_cache_memory).

    n_heads query heads of head_dim columns; n_kv_heads key/value heads, the ones that are
    cached: n_kv_heads == n_heads is multi-head attention (MHA), 1 is multi-query attention
    (MQA), anything between is grouped-query attention (GQA). n_parameters counts every
    weight, so that the weights can be set beside the cache. `source` names where the
    numbers come from.

    Two more kinds of cache (latent_attention and sliding_windows_and_sinks): latent_dim
    (with rope_head_dim) for multi-head latent attention, which caches latent_dim + rope_head_dim
    numbers a token and layer
    (n_kv_heads x head_dim then describe the heads it rebuilds, for comparison); and window for a
    sliding window, whose cache never holds more than window positions.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    n_parameters: int
    source: str
    latent_dim: int | None = None
    rope_head_dim: int = 0
    window: int | None = None

    @property
    def attention(self) -> str:
        """'MHA', 'GQA', 'MQA' (from the number of K/V heads) or 'MLA' (latent)."""
        return attention_kind(self.n_heads, self.n_kv_heads, self.latent_dim)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes that one more token adds to the cache: 2 x n_layers x n_kv_heads x head_dim
        x dtype_bytes (BF16 by default)."""
        return self.kv_cache_bytes(1, dtype_bytes=dtype_bytes)

    def kv_cache_bytes(self, seq_len: int, batch_size: int = 1, dtype_bytes: int = 2) -> int:
        """kv_cache_bytes for this model's layers and K/V heads (latent_cache_bytes for
        latent attention; with a window, for at most window positions)."""
        seq_len = as_whole_number("seq_len", seq_len)
        held = seq_len if self.window is None else min(seq_len, self.window)
        if self.latent_dim is not None:
            return latent_cache_bytes(self.n_layers, self.latent_dim, self.rope_head_dim, held,
                                      batch_size, dtype_bytes)
        return kv_cache_bytes(self.n_layers, None, held, batch_size, dtype_bytes,
                              n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)

    def mha_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """What one token would cost with a K and a V for every query head (multi-head
        attention at the same shapes): 2 x n_layers x n_heads x head_dim x dtype_bytes."""
        return kv_cache_bytes(self.n_layers, None, 1, 1, dtype_bytes, n_kv_heads=self.n_heads,
                              head_dim=self.head_dim)

    def weights_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of the weights at dtype_bytes a weight (BF16 by default)."""
        return weights_bytes(self.n_parameters, dtype_bytes)


PRESETS: dict[str, ModelPreset] = {preset.name: preset for preset in (
    ModelPreset(
        "GPT-2 small", n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, head_dim=64,
        context_length=1024, n_parameters=124_439_808,
        source="Radford et al. 2019, 'Language Models are Unsupervised Multitask Learners'; "
               "config.json of openai-community/gpt2 (n_layer 12, n_embd 768, n_head 12)"),
    ModelPreset(
        "Llama-2-7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, head_dim=128,
        context_length=4096, n_parameters=6_738_415_616,
        source="Touvron et al. 2023, 'Llama 2: Open Foundation and Fine-Tuned Chat Models'; "
               "config.json of meta-llama/Llama-2-7b-hf (32 layers, hidden 4096, 32 heads, "
               "32 K/V heads)"),
    ModelPreset(
        "Llama-3-8B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        context_length=8192, n_parameters=8_030_261_248,
        source="Meta Llama 3 model card; config.json of meta-llama/Meta-Llama-3-8B "
               "(32 layers, hidden 4096, 32 heads, 8 K/V heads)"),
    ModelPreset(
        "Llama-2-70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
        context_length=4096, n_parameters=68_976_648_192,
        source="Touvron et al. 2023, 'Llama 2' (grouped-query attention for 34B and 70B); "
               "config.json of meta-llama/Llama-2-70b-hf (80 layers, hidden 8192, 64 heads, "
               "8 K/V heads)"),
    ModelPreset(
        "Falcon-7B", n_layers=32, d_model=4544, n_heads=71, n_kv_heads=1, head_dim=64,
        context_length=2048, n_parameters=6_921_720_704,
        source="config.json of tiiuae/falcon-7b (n_layer 32, hidden_size 4544, n_head 71, "
               "multi_query true: one K/V head of 64 shared by all 71 query heads)"),
    ModelPreset(
        "source example (d 8192, 80 layers, MHA)", n_layers=80, d_model=8192, n_heads=64,
        n_kv_heads=64, head_dim=128, context_length=4096, n_parameters=12 * 80 * 8192**2,
        source="the blog section this series follows: d_model 8192, 80 layers, 4096 tokens; "
               "64 heads of 128 assumed; weights estimated as 12 x layers x d_model^2 (the "
               "source gives no vocabulary, so embeddings are left out)"),
    ModelPreset(
        "Mistral-7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        context_length=8192, n_parameters=7_241_732_096, window=4096,
        source="Jiang et al. 2023, 'Mistral 7B', Table 1 (32 layers, dim 4096, 32 heads, "
               "8 K/V heads of 128, window 4096, context 8192); config.json of "
               "mistralai/Mistral-7B-v0.1 (sliding_window 4096)"),
    ModelPreset(
        "DeepSeek-V2", n_layers=60, d_model=5120, n_heads=128, n_kv_heads=128, head_dim=128,
        context_length=131072, n_parameters=236_000_000_000, latent_dim=512, rope_head_dim=64,
        source="DeepSeek-AI 2024, 'DeepSeek-V2: A Strong, Economical, and Efficient "
               "Mixture-of-Experts Language Model' (MLA, 236B parameters, 128K context); "
               "config.json of deepseek-ai/DeepSeek-V2 (60 layers, hidden 5120, 128 heads, "
               "kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128)"),
    ModelPreset(
        "DeepSeek-V3", n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128, head_dim=128,
        context_length=131072, n_parameters=671_000_000_000, latent_dim=512, rope_head_dim=64,
        source="DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report' (MLA, 671B parameters, 128K "
               "context); config.json of deepseek-ai/DeepSeek-V3 (61 layers, hidden 7168, "
               "128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128)"),
)}
"""Published configurations, by name, for the kv_cache_memory lesson's calculator."""
