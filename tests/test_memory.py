"""The KV cache memory formula against the source's example."""

import pytest

import kvlib
from kvlib import GiB, MiB, kv_cache_bytes


def test_the_source_example():
    assert kv_cache_bytes(n_layers=1, d_model=8192, seq_len=4096) == 128 * MiB
    assert kv_cache_bytes(n_layers=80, d_model=8192, seq_len=4096) == 10 * GiB
    assert kv_cache_bytes(80, 8192, 4096, batch_size=64) == 640 * GiB
    assert kv_cache_bytes(80, 8192, 4096, dtype_bytes=4) == 20 * GiB


def test_kv_heads_and_head_size_given_separately():
    assert kv_cache_bytes(80, None, 4096, n_kv_heads=64, head_dim=128) == 10 * GiB
    # Llama-2-70B caches 8 K/V heads of 128: 327,680 bytes a token in BF16
    assert kv_cache_bytes(80, None, 1, n_kv_heads=8, head_dim=128) == 327_680
    with pytest.raises(ValueError, match="both"):
        kv_cache_bytes(80, 8192, 10, n_kv_heads=8)
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(80, 8192, -1)


def test_live_cache_matches_formula_in_float32():
    config = kvlib.ModelConfig(dtype="float32")
    params = kvlib.init_params(config)
    _, cache = kvlib.prefill(params, [0, 3, 7, 1, 9])
    assert cache.nbytes == kv_cache_bytes(3, 4, 5, dtype_bytes=4) == 2 * 5 * 4 * 4 * 3
