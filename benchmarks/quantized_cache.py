"""The quantized KV cache (notebook 22): bytes per token, what fits, what it costs in time in
numpy, and what it costs the trained story model.

Prints three tables:

1. bytes one token adds to the cache at published shapes (kvlib.memory.PRESETS), for
   float16 and for int8 / int4 / int2 caches with their float16 scales, per token or KIVI's
   way (keys per channel in groups of 32, values per token), with the factor against
   float16, and how many tokens fit in an 80 GiB accelerator beside the BF16 weights. Exact,
   the same on every machine; every figure is also checked against the nbytes of a live
   kvlib cache of those shapes (a few layers are enough: the bytes scale with them).
2. kvlib's decode speed at GPT-2 small's shapes (12 layers, 768 wide, float32, random
   weights, one BLAS thread) after a few cached lengths, with a plain KVCache and with
   quantized ones: numpy dequantizes the whole cache at every read (no fused kernel), so a
   quantized step is slower here, and more so the longer the cache. Beside it, the bytes a
   step must read (every weight and the whole cache) and the speed-up they predict for a
   memory-bound step whose kernel reads the codes directly (fused dequantization), as GPUs
   run it. Timings: the settings are measured in turn, several rounds, keeping each one's
   fastest, so that a load that comes and goes on the machine is shared out.
3. on the trained story model (kvlib/models/stories), for 8, 4 and 2 bits and four
   pairings of groupings: the mean and largest change of the logits, the held-out loss and
   the share of unchanged greedy picks, over held-out sequences (exact, deterministic).
   Skipped, with a note, when the model is not there.

    python benchmarks/quantized_cache.py            # about a minute
    python benchmarks/quantized_cache.py --quick    # a few seconds: fewer lengths, layers
                                                    # and sequences
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import report  # benchmarks/report.py: threads, machine lines, tables

for _variable in report.THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")   # before numpy: one thread, as benchmarks/decode.py

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
import kvlib.gpt2  # noqa: E402
from kvlib.memory import PRESETS, GiB, tokens_that_fit, weights_bytes  # noqa: E402
from kvlib.serving import quantized  # noqa: E402
from kvlib.serving.quantized import PerChannel, PerToken, QuantizedKVCache  # noqa: E402

SETTINGS = {
    "float16": None,
    "int8 per token": (PerToken(8), PerToken(8)),
    "int8 KIVI": (PerChannel(8, 32), PerToken(8)),
    "int4 per token": (PerToken(4), PerToken(4)),
    "int4 KIVI": (PerChannel(4, 32), PerToken(4)),
    "int2 KIVI": (PerChannel(2, 32), PerToken(2)),
}
MODELS = ("GPT-2 small", "Llama-2-7B", "Llama-3-8B", "Llama-2-70B")
MEMORY = 80 * GiB
STORIES = Path(kvlib.__file__).resolve().parent / "models" / "stories"
PAIRINGS = {"K and V per token": (PerToken, PerToken),
            "K and V per channel": (PerChannel, PerChannel),
            "KIVI (K channel, V token)": (PerChannel, PerToken),
            "K token, V channel": (PerToken, PerChannel)}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 2 layers, 2 lengths, 1 held-out sequence")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="cached lengths at which a decode step is timed "
                             "(default 128 512 1000; 64 256 with --quick)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the timed model (default 12; 2 with --quick)")
    parser.add_argument("--sequences", type=int, default=None,
                        help="held-out sequences of 256 tokens (default 8; 1 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of timing; each setting keeps its fastest (default 5; "
                             "2 with --quick)")
    parser.add_argument("--steps", type=int, default=10,
                        help="decode steps timed in a round (default 10)")
    arguments = parser.parse_args(argv)
    quick = arguments.quick
    arguments.lengths = arguments.lengths or ([64, 256] if quick else [128, 512, 1000])
    arguments.layers = arguments.layers or (2 if quick else 12)
    arguments.sequences = arguments.sequences or (1 if quick else 8)
    arguments.rounds = arguments.rounds or (2 if quick else 5)
    return arguments


def setting_bytes(setting, n_layers: int, width: int) -> float:
    if setting is None:
        return 2 * 2 * n_layers * width
    return quantized.bytes_per_token(n_layers, width, *setting)


def live_bytes(setting, n_kv_heads: int, head_dim: int, n_positions: int = 64) -> float:
    """Bytes per token per layer measured on a live QuantizedKVCache of one layer filled
    with n_positions (a multiple of 32: no residual) random rows of the model's width."""
    width = n_kv_heads * head_dim
    config = kvlib.ModelConfig(d_model=width, n_heads=n_kv_heads, n_layers=1,
                               context_length=n_positions, dtype="float32")
    cache = QuantizedKVCache(config, *setting)
    rows = np.random.default_rng(0).standard_normal((n_positions, width)).astype(np.float32)
    cache.append(0, rows, rows)
    return cache.nbytes / n_positions


def bytes_table() -> str:
    header = ["model", "K/V width", "setting", "bytes/token", "vs float16",
              "tokens in 80 GiB"]
    rows = []
    for name in MODELS:
        model = PRESETS[name]
        width = model.n_kv_heads * model.head_dim
        weights = weights_bytes(model.n_parameters, 2)
        for setting_name, setting in SETTINGS.items():
            per_token = setting_bytes(setting, model.n_layers, width)
            if setting is not None:
                measured = live_bytes(setting, model.n_kv_heads, model.head_dim)
                assert measured * model.n_layers == per_token, (name, setting_name)
            else:
                assert per_token == model.kv_bytes_per_token()
            fit = tokens_that_fit(MEMORY, weights, int(np.ceil(per_token)))
            rows.append([name, f"{width}", setting_name, f"{per_token:,.0f}",
                         f"{model.kv_bytes_per_token() / per_token:.2f}x",
                         f"{fit:,}" if weights < MEMORY else "weights > 80 GiB"])
    return report.table(header, rows)


def timing_table(arguments) -> str:
    config = kvlib.ModelConfig(vocab_size=50257, d_model=768, n_heads=12,
                               n_layers=arguments.layers, d_ff=3072, context_length=1024,
                               dtype="float32")
    params = kvlib.init_params(config, seed=0)
    makers = {"plain": lambda: kvlib.KVCache(config)}
    for name in ("int8 per token", "int4 KIVI"):
        makers[name] = lambda setting=SETTINGS[name]: QuantizedKVCache(config, *setting)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, max(arguments.lengths) + 1)
    best = {}
    caches = {}
    for length in arguments.lengths:
        for name, make in makers.items():
            _, caches[length, name] = kvlib.prefill(params, ids[:length], make())
    for _ in range(arguments.rounds):               # settings in turn, so load is shared
        for length in arguments.lengths:
            for name in makers:
                cache = caches[length, name]
                started = time.perf_counter()
                for _ in range(arguments.steps):
                    kvlib.decode_step(params, int(ids[length]), cache)
                    cache.truncate(length)
                seconds = (time.perf_counter() - started) / arguments.steps
                best[length, name] = min(best.get((length, name), np.inf), seconds)
    header = ["cached tokens"] + [f"{name} tok/s" for name in makers] + \
        [f"{name} / plain time" for name in list(makers)[1:]] + \
        ["MB read, plain", "MB read, int4 KIVI", "fused-kernel prediction"]
    weights = params.n_parameters * 4
    rows = []
    for length in arguments.lengths:
        plain = best[length, "plain"]
        # a memory-bound step reads every weight and the whole cache once; a fused kernel
        # reads the cache as it is stored, so its time would shrink with the bytes
        read_plain = weights + caches[length, "plain"].nbytes
        read_kivi = weights + caches[length, "int4 KIVI"].nbytes
        rows.append([f"{length}"] + [f"{1 / best[length, name]:.1f}" for name in makers]
                    + [f"{best[length, name] / plain:.2f}x" for name in list(makers)[1:]]
                    + [f"{read_plain / 1e6:.1f}", f"{read_kivi / 1e6:.1f}",
                       f"{read_plain / read_kivi:.2f}x faster"])
    return (f"model: {config.n_layers} layers, d_model 768, 12 heads, vocabulary 50257, "
            f"float32, random weights; {arguments.steps} steps a round, fastest of "
            f"{arguments.rounds} rounds\n\n" + report.table(header, rows))


def quality_table(arguments) -> str:
    if not (STORIES / "model.safetensors").is_file():
        return f"(skipped: no trained model in {STORIES})"
    from kvlib.stories.corpus import HELD_OUT_SEED, story_sequences

    params = kvlib.gpt2.load(STORIES, dtype="float32")
    sequences = story_sequences(arguments.sequences, HELD_OUT_SEED)
    reference = quantized.plain_logits(params, sequences)
    rows = []
    plain_loss = None
    for bits in (8, 4, 2):
        for pairing, (key_kind, value_kind) in PAIRINGS.items():
            keys = key_kind(bits) if key_kind is PerToken else key_kind(bits, 32)
            values = value_kind(bits) if value_kind is PerToken else value_kind(bits, 32)
            q = quantized.measure_quality(params, sequences, keys, values, reference)
            plain_loss = q.plain_loss
            rows.append([f"{bits}", pairing, f"{q.bytes_per_token:,.0f}",
                         f"{q.logit_error:.4f}", f"{q.max_logit_error:.3f}", f"{q.loss:.4f}",
                         f"{q.added_loss:+.4f}", f"{100 * q.agreement:.2f}%"])
    header = ["bits", "grouping", "bytes/token", "mean abs dlogit", "max abs dlogit", "loss",
              "added loss", "same greedy"]
    return (f"story model ({params.config.n_layers} layers, d_model {params.config.d_model}), "
            f"{len(sequences)} held-out sequences of {sequences.shape[1]} tokens; plain cache "
            f"loss {plain_loss:.4f} nats a token\n\n" + report.table(header, rows))


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    print("## Bytes per token, with the scales (exact)\n")
    print(bytes_table())
    print("\n## kvlib decode speed, plain against quantized caches (this machine)\n")
    print(timing_table(arguments))
    print("\n## Quality on the trained story model (exact)\n")
    print(quality_table(arguments))
    return 0


if __name__ == "__main__":
    sys.exit(main())
