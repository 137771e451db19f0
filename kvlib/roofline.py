"""From counts to time (where_time_goes and benchmarks/decode.py): how fast this machine reads
memory and multiplies matrices, and the roofline model built on those two rates.

A pass through the model needs a number of FLOPs (kvlib.flops) and has to read a number of
bytes from memory at least once (the weights, and the cached keys and values). Whichever
takes longer sets the time:

    time = max(FLOPs / compute rate, bytes / bandwidth)

Recomputing a whole sequence multiplies matrices by matrices: many FLOPs for every byte
read, so it is limited by arithmetic. A cached decode step multiplies one row by every weight
matrix: two FLOPs for every weight read, so it is limited by how fast memory is read.

The measuring functions use numpy only and return rates in FLOP/s and bytes/s. They measure
whatever this machine does at the moment they run: use them for plots and printed reports,
never for assertions.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import time

import numpy as np

from .checks import (
    as_array,
    as_config,
    as_count,
    as_real_number,
    as_sizes,
    as_whole_number,
    as_whole_numbers,
)
from .config import ModelConfig
from .flops import MAX_PASSES, decode_step_multiply_adds, generation_step_flops
from .memory import config_cache_bytes
from .params import Params, layer_class

MiB = 2**20


# ----------------------------------------------------------------------------- bytes read


def weights_bytes(config: ModelConfig) -> int:
    """Bytes of all the weights (counting_the_work and where_time_goes): for the toy's architecture
    (V d + L (4 d^2 + 2 d f)) x bytes a number; in general the sizes of every array the
    config needs (biases, norms, positions, narrower K/V, latent projections).

    The lookup table is counted once: the unembedding reads the same table (tied weights).
    Equal to init_params(config).n_parameters x itemsize.
    """
    config = as_config(config)
    shapes = list(Params.expected_shapes(config).values())
    shapes += config.n_layers * list(layer_class(config).expected_shapes(config).values())
    return sum(int(np.prod(shape)) for shape in shapes) * config.numpy_dtype.itemsize


def cache_bytes(config: ModelConfig, n_positions: int) -> int:
    """Bytes of the keys and values of n_positions, in every layer
    (counting_the_work and where_time_goes): 2 x L x n_positions x d x bytes a number, the
    kv_cache_bytes formula at batch 1
    (with fewer K/V heads, a latent or a window, what that cache holds:
    kvlib.config_cache_bytes)."""
    return config_cache_bytes(config, n_positions)


def decode_step_bytes(config: ModelConfig, position: int) -> int:
    """Bytes a cached decode step must read (where_time_goes) for the token at 0-based `position`:
    every weight once (each matrix meets the new row once; the unembedding reads the whole
    table), and the keys and values of the position + 1 positions it attends over."""
    return weights_bytes(config) + cache_bytes(config, as_whole_number("position", position) + 1)


def forward_bytes(config: ModelConfig, n_tokens: int) -> int:
    """Bytes a full recomputation over n_tokens must read at least once (where_time_goes): the
    weights, and the keys and values it computes and attends over. (The other activations
    are left out: they are small beside the weights and often stay in the CPU's caches.)"""
    return weights_bytes(config) + cache_bytes(config, as_whole_number("n_tokens", n_tokens, 1))


def generation_step_bytes(config: ModelConfig, prompt_length: int, new_tokens: int,
                          use_cache: bool = True) -> np.ndarray:
    """Bytes read by each pass that produces a new token: an int array (new_tokens,).

    The passes are those of kvlib.flops.generation_step_multiply_adds: with the cache, a
    prefill of the prompt then decode steps; without, full forwards over a growing sequence.
    Pass i reads the weights and the keys and values of prompt_length + i positions either
    way (the decode step at position prompt_length + i - 1 attends over prompt_length + i
    positions): the cache changes the FLOPs, not the bytes. use_cache is accepted so that
    the call reads like its FLOP counterpart.
    """
    config = as_config(config)
    prompt_length = as_count("prompt_length", prompt_length, 1)
    new_tokens = as_whole_number("new_tokens", new_tokens, 1, MAX_PASSES)   # one count a pass
    weights = weights_bytes(config)                    # the same for every pass: count it once
    if config.window is None:           # every position held: the cache grows by one row a pass
        lengths = np.arange(prompt_length, prompt_length + new_tokens, dtype=np.int64)
        return weights + cache_bytes(config, 1) * lengths
    lengths = range(prompt_length, prompt_length + new_tokens)
    return np.array([weights + cache_bytes(config, n) for n in lengths], dtype=np.int64)


# ----------------------------------------------------------------------------- the model


def roofline_time(flops, n_bytes, compute_rate: float, bandwidth: float):
    """Predicted seconds (where_time_goes): max(flops / compute_rate, n_bytes / bandwidth).

    flops and n_bytes may be numbers or arrays of the same shape; rates in FLOP/s and bytes/s.
    """
    flops, n_bytes = as_array("flops", flops), as_array("n_bytes", n_bytes)
    compute_rate = as_real_number("compute_rate", compute_rate, positive=True)
    bandwidth = as_real_number("bandwidth", bandwidth, positive=True)
    if flops.shape != n_bytes.shape and flops.ndim and n_bytes.ndim:
        raise ValueError(f"flops and n_bytes must have one shape, got {flops.shape} and "
                         f"{n_bytes.shape}")
    if (flops < 0).any() or (n_bytes < 0).any():
        raise ValueError("flops and n_bytes count work and bytes: they cannot be negative")
    times = np.maximum(flops.astype(np.float64) / compute_rate,
                       n_bytes.astype(np.float64) / bandwidth)
    return float(times) if times.ndim == 0 else times


def arithmetic_intensity(flops, n_bytes):
    """FLOPs per byte read (where_time_goes): above compute_rate / bandwidth, arithmetic sets the
    time; below it, memory does."""
    flops = as_array("flops", flops).astype(np.float64)
    n_bytes = as_array("n_bytes", n_bytes).astype(np.float64)
    if not np.isfinite(flops).all() or not (n_bytes > 0).all() or not np.isfinite(n_bytes).all():
        raise ValueError("flops must be finite numbers and n_bytes finite positive ones")
    with np.errstate(over="ignore"):        # a tiny byte count overflows to inf, its limit
        result = flops / n_bytes
    return float(result) if result.ndim == 0 else result


def matmul_intensity(rows: int, inner: int, columns: int, itemsize: int = 4) -> float:
    """FLOPs per byte of X (rows, inner) @ W (inner, columns) (where_time_goes): 2 rows inner
    columns FLOPs over the bytes of X, W and the result. About rows / 2 for one float32 row
    against a large matrix: decode (rows = 1) does 0.5 FLOP per byte."""
    rows, inner, columns, itemsize = as_sizes(1, rows=rows, inner=inner, columns=columns,
                                              itemsize=itemsize)
    flops = 2 * rows * inner * columns
    n_bytes = itemsize * (rows * inner + inner * columns + rows * columns)
    return flops / n_bytes


def generation_step_times(config: ModelConfig, prompt_length: int, new_tokens: int,
                          use_cache: bool, compute_rate: float, bandwidth: float) -> np.ndarray:
    """Roofline prediction of each pass's seconds (where_time_goes): an array (new_tokens,)."""
    compute_rate = as_real_number("compute_rate", compute_rate, positive=True)
    bandwidth = as_real_number("bandwidth", bandwidth, positive=True)
    flops = generation_step_flops(config, prompt_length, new_tokens, use_cache)
    n_bytes = generation_step_bytes(config, prompt_length, new_tokens, use_cache)
    return roofline_time(flops, n_bytes, compute_rate, bandwidth)


# ------------------------------------------------------------------ the roofline of a batch


def batched_step_flops(config: ModelConfig, positions) -> int:
    """FLOPs of one batched decode step (batched_decoding): each sequence's decode step at its
    position, summed. Batching changes how the work is done, not how much there is."""
    positions = as_whole_numbers("positions", positions, empty=False).tolist()
    return sum(decode_step_multiply_adds(config, p).flops for p in positions)


def batched_step_bytes(config: ModelConfig, positions, bytes_per_number: int | None = None
                       ) -> int:
    """Bytes one batched decode step must read (batched_decoding): every weight once for the
    whole batch, and each sequence's own keys and values (position + 1 positions each).

    bytes_per_number gives the bytes of a stored number (2 for BF16 on an accelerator);
    by default the config's dtype (4 for float32).
    """
    if bytes_per_number is not None:
        bytes_per_number = as_whole_number("bytes_per_number", bytes_per_number, 1, 64)
    positions = as_whole_numbers("positions", positions, empty=False).tolist()
    cached = sum(cache_bytes(config, p + 1) for p in positions)
    return _in_bytes_of(config, weights_bytes(config) + cached, bytes_per_number)


def batched_step_seconds(config: ModelConfig, positions, compute_rate: float,
                         bandwidth: float, bytes_per_number: int | None = None) -> float:
    """The roofline's time of one batched decode step (batched_decoding):
    max(FLOPs / compute_rate, bytes / bandwidth), in seconds."""
    compute_rate = as_real_number("compute_rate", compute_rate, positive=True)
    bandwidth = as_real_number("bandwidth", bandwidth, positive=True)
    return roofline_time(batched_step_flops(config, positions),
                         batched_step_bytes(config, positions, bytes_per_number),
                         compute_rate, bandwidth)


def ridge_point(compute_rate: float, bandwidth: float) -> float:
    """FLOPs per byte at which a machine turns from memory-bound to compute-bound
    (batched_decoding): compute_rate / bandwidth. An H100 SXM: 989e12 / 3.35e12, about 295."""
    compute_rate = as_real_number("compute_rate", compute_rate, positive=True)
    bandwidth = as_real_number("bandwidth", bandwidth, positive=True)
    return compute_rate / bandwidth


def compute_bound_batch_size(config: ModelConfig, position: int, compute_rate: float,
                             bandwidth: float, bytes_per_number: int | None = None
                             ) -> int | None:
    """The smallest batch of sequences, each decoding at `position`, whose step the roofline
    calls compute-bound (batched_decoding): FLOPs / compute_rate >= bytes / bandwidth. None when
    no batch ever is: when one sequence's cache takes longer to read than its FLOPs take
    to compute, every sequence added brings more reading than arithmetic.

    With B sequences, FLOPs = B f and bytes = W + B c (f, c: one sequence's FLOPs and cache
    bytes, W: the weights), so B >= (W / bandwidth) / (f / compute_rate - c / bandwidth).
    """
    compute_rate = as_real_number("compute_rate", compute_rate, positive=True)
    bandwidth = as_real_number("bandwidth", bandwidth, positive=True)
    if bytes_per_number is not None:
        bytes_per_number = as_whole_number("bytes_per_number", bytes_per_number, 1, 64)
    position = as_whole_number("position", position)
    flops_each = batched_step_flops(config, [position])
    weights = _weights_bytes(config, bytes_per_number)
    cache_each = batched_step_bytes(config, [position], bytes_per_number) - weights
    spare = flops_each * bandwidth - cache_each * compute_rate     # per sequence, x rates
    if spare <= 0:
        return None
    size = max(1, math.ceil(weights * compute_rate / spare))
    # the division is in floats; settle the boundary with the comparison itself
    def bound(b):
        return b * flops_each * bandwidth >= (weights + b * cache_each) * compute_rate
    while size > 1 and bound(size - 1):
        size -= 1
    while not bound(size):
        size += 1
    return size


def _in_bytes_of(config: ModelConfig, n_bytes: int, bytes_per_number: int | None) -> int:
    """n_bytes of the config's dtype, counted with bytes_per_number bytes a number."""
    if bytes_per_number is None:
        return n_bytes
    return n_bytes // config.numpy_dtype.itemsize * bytes_per_number


def _weights_bytes(config: ModelConfig, bytes_per_number: int | None) -> int:
    return _in_bytes_of(config, weights_bytes(config), bytes_per_number)


def batched_step_cost(config: ModelConfig, batch: int, position: int,
                      bytes_per_number: int | None = None) -> dict:
    """What one decode step of `batch` sequences reads and computes (where_time_goes), every
    sequence at 0-based `position`, so that each attends over position + 1 cached positions.

    The weights are read once for the whole batch; each sequence's keys and values are read
    for it alone. Returns FLOPs, bytes of the weights, of the caches, in all, and the
    arithmetic intensity (FLOPs per byte). bytes_per_number: 4 for float32 (the config's
    own, by default), 2 for BF16 on an accelerator.
    """
    position, batch = as_whole_number("position", position), as_whole_number("batch", batch, 1)
    if bytes_per_number is not None:
        bytes_per_number = as_whole_number("bytes_per_number", bytes_per_number, 1, 64)
    flops = batch * batched_step_flops(config, [position])       # every sequence alike
    weights = _weights_bytes(config, bytes_per_number)
    total = weights + batch * (batched_step_bytes(config, [position], bytes_per_number) - weights)
    return {"flops": float(flops), "weights": float(weights), "caches": float(total - weights),
            "bytes": float(total), "intensity": flops / total}


# ----------------------------------------------------------------------------- measuring


def _seconds_of_each(function, repeats: int) -> np.ndarray:
    function()  # once to warm up (page faults, BLAS start-up)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return np.array(seconds)


def _median_rate(amount: float, seconds: np.ndarray, record: list | None) -> float:
    """amount / the median of the timings; each repeat's rate goes to `record` (a list)."""
    if record is not None:
        record.extend(float(amount / s) for s in seconds)
    return float(amount / np.median(seconds))


def measure_read_bandwidth(n_bytes: int = 256 * MiB, repeats: int = 5,
                           record: list | None = None) -> float:
    """How fast numpy reads a large float32 array from memory, in bytes/s (where_time_goes).

    The array is dotted with itself: every byte is read once, with one multiply-add per
    4 bytes, far too little arithmetic to matter. The median of `repeats` readings, so that
    one slow moment (another program on the machine) does not set the figure; a list given
    as `record` receives every reading, whose spread tells how busy the machine was. Make
    n_bytes several times the CPU's last-level cache, or the cache is measured instead of
    memory.
    """
    n_bytes, repeats = as_whole_number("n_bytes", n_bytes, 4096), as_whole_number("repeats",
                                                                                   repeats, 1)
    array = np.ones(n_bytes // 4, dtype=np.float32)
    seconds = _seconds_of_each(lambda: np.dot(array, array), repeats)
    return _median_rate(array.nbytes, seconds, record)


def measure_matmul_rate(size: int = 1024, dtype: str = "float32", repeats: int = 5,
                        record: list | None = None) -> float:
    """How fast numpy multiplies two square matrices (size, size), in FLOP/s (where_time_goes):
    2 size^3 FLOPs, the median of `repeats` products (each one's rate goes to `record`, a
    list, when given). This is the compute rate of the roofline."""
    size, repeats = as_sizes(1, size=size, repeats=repeats)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((size, size)).astype(dtype)
    B = rng.standard_normal((size, size)).astype(dtype)
    return _median_rate(2 * size**3, _seconds_of_each(lambda: A @ B, repeats), record)


def measure_matmul_rows(weight: np.ndarray, rows: int, repeats: int = 5,
                        record: list | None = None) -> float:
    """FLOP/s of X (rows, inner) @ weight (inner, columns) (where_time_goes): how the rate grows
    with the number of rows multiplied at once (1 for decode, the prompt length for prefill).
    The median of `repeats`; each one's rate goes to `record` (a list) when given."""
    weight, (rows, repeats) = as_array("weight", weight, 2), as_sizes(1, rows=rows, repeats=repeats)
    X = np.ones((rows, weight.shape[0]), dtype=weight.dtype)
    seconds = _seconds_of_each(lambda: X @ weight, repeats)
    return _median_rate(2 * rows * weight.size, seconds, record)


def time_cached_generation(params, prompt, new_tokens: int, cache=None, repeats: int = 1):
    """Greedy generation with the cache, timing each pass (where_time_goes, the benchmark).

    Pass 0 is kvlib.prefill of the prompt (it gives the first new token), pass i >= 1 a
    kvlib.decode_step. Returns (the new_tokens new ids, seconds of each pass: array
    (new_tokens,)); with repeats > 1 the generation is run again with a fresh cache of the
    same kind and each pass keeps its fastest time. `cache` (empty) chooses the kind:
    kvlib.KVCache by default, or kvlib.ConcatenatingKVCache.
    """
    from .cache import make_cache
    from .inference import decode_step, prefill

    new_tokens, repeats = as_sizes(1, new_tokens=new_tokens, repeats=repeats)
    if cache is not None and len(cache) != 0:
        raise ValueError("give an empty cache: the generation starts from the prompt")
    best, new_ids = None, []
    for run in range(repeats):
        if run == 0 and cache is not None:
            current = cache
        else:
            current = make_cache(params.config) if cache is None else type(cache)(params.config)
        seconds, new_ids = [], []
        start = time.perf_counter()
        logits, current = prefill(params, prompt, current, last_only=True)
        token = int(np.argmax(logits[-1]))
        seconds.append(time.perf_counter() - start)
        new_ids.append(token)
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            logits = decode_step(params, token, current)
            token = int(np.argmax(logits[-1]))
            seconds.append(time.perf_counter() - start)
            new_ids.append(token)
        best = np.array(seconds) if best is None else np.minimum(best, seconds)
    return new_ids, best


def time_recomputation(params, sequence, lengths, repeats: int = 1,
                       return_tokens: bool = False):
    """Seconds of a full recomputation, no cache, at each given length (where_time_goes, the
    benchmark): kvlib.forward over sequence[:n], unembedding only the last row, as
    kvlib.generate does without the cache. Returns an array (len(lengths),), the fastest of
    `repeats`; with return_tokens=True also the greedy token each forward chose."""
    from .inference import forward

    repeats = as_whole_number("repeats", repeats, 1)
    sequence = list(sequence)
    seconds, tokens = [], []
    for n in as_whole_numbers("lengths", lengths, minimum=1).tolist():
        if n > len(sequence):
            raise ValueError(f"length {n} is longer than the sequence ({len(sequence)} tokens)")
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            logits = forward(params, sequence[:n], last_only=True)
            token = int(np.argmax(logits[-1]))   # choosing the token is part of the pass
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
        tokens.append(token)
    return (np.array(seconds), tokens) if return_tokens else np.array(seconds)


def time_appends(config: ModelConfig, cache_class, cached: int, repeats: int = 5) -> float:
    """Seconds to append one token's K and V to every layer of a cache that already holds
    `cached` positions (where_time_goes, the benchmark), the median of `repeats` appends.
    cache_class is kvlib.KVCache (in place) or kvlib.ConcatenatingKVCache (a copy)."""
    config, (cached, repeats) = as_config(config), as_sizes(1, cached=cached, repeats=repeats)
    if cached + repeats > config.context_length:
        raise ValueError(f"{cached} cached positions and {repeats} appends need a context "
                         f"length of {cached + repeats}; the config has {config.context_length}")
    cache = cache_class(config, capacity=cached + repeats)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((cached, config.kv_width)).astype(config.numpy_dtype)
    row = block[:1].copy()
    for layer in range(config.n_layers):
        cache.append(layer, block, block)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(config.n_layers):
            cache.append(layer, row, row)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


# ----------------------------------------------------------------------------- BLAS threads

_THREAD_FUNCTIONS = ("scipy_openblas_{}_num_threads64_", "openblas_{}_num_threads64_",
                     "scipy_openblas_{}_num_threads", "openblas_{}_num_threads")


def _openblas_library():
    """The OpenBLAS library numpy is linked to, loaded with ctypes; None if not found."""
    candidates = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            candidates += [line.split()[-1] for line in maps if "openblas" in line.lower()]
    except OSError:
        pass
    numpy_dir = os.path.dirname(np.__file__)
    for pattern in ("numpy.libs/*openblas*", ".dylibs/*openblas*", "../numpy.libs/*openblas*"):
        candidates += glob.glob(os.path.join(numpy_dir, pattern))
    for path in dict.fromkeys(candidates):
        if not os.path.isfile(path):
            continue
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _THREAD_FUNCTIONS:
            if hasattr(library, name.format("get")):
                return library, name
    return None


def blas_threads() -> int | None:
    """How many threads numpy's BLAS uses now (benchmarks/decode.py, the where_time_goes lesson),
    asked of OpenBLAS itself; None when numpy is linked to another BLAS or the library is not
    found."""
    found = _openblas_library()
    if found is None:
        return None
    library, name = found
    get = getattr(library, name.format("get"))
    get.restype = ctypes.c_int
    return int(get())


def set_blas_threads(n_threads: int) -> int | None:
    """Ask OpenBLAS to use n_threads from now on (where_time_goes); returns the count now in
    effect, or None (nothing changed) when numpy is not linked to OpenBLAS."""
    n_threads = as_whole_number("n_threads", n_threads, 1)
    found = _openblas_library()
    if found is None:
        return None
    library, name = found
    setter = getattr(library, name.format("set"), None)
    if setter is None:
        return None
    setter.argtypes = [ctypes.c_int]
    setter(int(n_threads))
    return blas_threads()


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Set any of these in the environment before Python starts and kvlib leaves the BLAS alone."""


def one_blas_thread_unless_set() -> int | None:
    """Run numpy's BLAS on one thread, unless the environment already chose (kvlib does this
    when it is imported). Lessons and laptops in class are busy machines, where OpenBLAS's
    default of a thread per core made single cells 5-30 times slower than one thread; a kernel
    started by make, Binder or the tests has one thread already, and an editor's or a
    JupyterHub's kernel gets it here. The way out: OPENBLAS_NUM_THREADS=4 (or OMP_ / MKL_) in
    the environment, or set_blas_threads(n) at any time."""
    if any(variable in os.environ for variable in BLAS_THREAD_VARIABLES):
        return None
    return set_blas_threads(1)


def blas_name() -> str:
    """Name and version of the BLAS numpy was built with, from numpy's build configuration."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', 'unknown')} {blas.get('version', '')}".strip()
    except Exception:  # the layout of the configuration differs between numpy builds
        return "unknown"
