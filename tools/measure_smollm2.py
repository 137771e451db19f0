"""Measure SmolLM2-135M-Instruct for the lessons, once, and keep the numbers small
(kvlib/models/smollm2/measured.json; the lessons load it with
kvlib.checkpoints.smollm2.measured()).

    python tools/measure_smollm2.py                 # every part (about 10 minutes, one thread)
    python tools/measure_smollm2.py pairing sinks   # some parts; the others are kept

The text: the first 1024 tokens of Python's own documentation of its keywords and statements
(pydoc_data.topics, the topics in sorted order, joined by blank lines), whose ids are kept in
the file so that the lessons and a later Python read the same tokens. Every loss is the mean
next-token loss in nats over those 1024 tokens (1023 predictions), computed by a full forward
(kvlib.forward) unless said otherwise.

Parts:
- pairing (notebooks 14 and 18): the loss with the GGUF's interleaved pairing and with the
  wrong (half) one, how often their top-1 tokens agree, and their largest logit difference;
  and both pairings' losses of the first FIRST_TOKENS - 1 predictions one by one, which a
  notebook recomputes from those tokens alone (a causal model's first predictions never see
  the tokens after them);
- sinks (notebook 17): the mean attention every head puts on position 0, over query positions
  64-1023, against the even share 1/(t+1);
- windows (notebook 17): the loss with a sliding window of 64 and 256, with 0 and 4 attention
  sinks, keys at their original positions (kvlib's sliding window) and, for 4 sinks, at their
  positions inside the cache as StreamingLLM assigns them;
- outliers (notebook 22): each cached key and value channel's mean |x| after a prefill of the
  text, the largest channel over the median, per layer and K/V head;
- kivi (notebook 22): the loss with quantized caches (kvlib.serving.quantized, teacher-forced
  decode steps: 1024 steps a configuration, the slow part);
- engine (notebook 24): the lesson's chat workload (kvlib.serving.workloads.workload) served by
  the engine and its variants, counted in steps and tokens, with each step's tokens and
  decodes (no seconds: those go to benchmarks/engine.py), every variant's outputs checked
  equal;
- kivi_free (notebook 22): free-running greedy decoding of FREE_TOKENS tokens after each of
  the KIVI_FREE_PROMPTS (chat requests, rendered with the chat template) with the plain cache
  and with each configuration of the kivi part: the tokens, how many match the plain
  cache's before the first difference, and the fraction equal overall (about 2 minutes);
- kernels (notebook 22): the first KERNEL_TOKENS tokens of the sky's answer (the third of the
  KIVI_FREE_PROMPTS), plain and with int4 keys per channel, under each of OpenBLAS's KERNELS
  (OPENBLAS_CORETYPE, each run in a process of its own; x86 only): where a free-running
  quantized run parts from the plain one depends on the processor's rounding, and the lesson
  shows the spread instead of one machine's answer; with the plain run's smallest gap between
  its top two logits, which says how far its tokens are from a flip;
- long (notebook 14): the next-token loss of LONG_TOKENS tokens of the same text, past SmolLM2's
  trained context of 8,192, in buckets of LONG_BUCKET positions (a chunked prefill through a
  cache, the context stretched as rotary positions allow), and of the same text started 4,096
  tokens later, so that the tokens past the trained length sit inside it: what position alone
  does past the trained length (about 15 minutes);
- heads (notebook 13): a real sentence said twice (HEADS_SENTENCE), every head's previous-token
  score and induction score (kvlib.heads), and the share of the second copy predicted right:
  the previous-token and induction heads the lesson shows offline, where GPT-2 124M's weights
  cannot be had;
- speculative (notebook 23): greedy speculative decoding without a second model on the
  SPECULATIVE_PROMPTS, FREE_TOKENS new tokens each: prompt lookup (kvlib's
  PromptLookupDrafter) at every k of SPECULATION_LENGTHS, and self-speculation (the first
  layers of SmolLM2 as its own draft): the greedy agreement of every exit in EXITS, and the
  decoder run with the exits in SELF_DRAFT_EXITS. Counted in target passes (rounds), never
  seconds; every output is checked equal to plain greedy decoding, and every
  self-speculative run's rounds to replay_greedy (about 6 minutes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import model as steps  # noqa: E402
from kvlib.checkpoints import smollm2  # noqa: E402
from kvlib.serving import quantized, speculative, workloads  # noqa: E402

N_TOKENS = 1024
FIRST_QUERY = 64          # sinks: query positions from here on
FIRST_TOKENS = 64        # pairing: the predictions kept one by one, for a notebook to recompute
WINDOWS = (64, 256)
SINKS = (0, 4)


def text_ids(tokenizer) -> list[int]:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return tokenizer.encode(text)[:N_TOKENS]


def loss(params, ids) -> float:
    return float(kvlib.next_token_losses(kvlib.forward(params, ids), ids).mean())


def run_pairing(params, ids) -> dict:
    right = kvlib.forward(params, ids)
    wrong = kvlib.forward(params.with_config(rope_pairing="half"), ids)
    right_losses = kvlib.next_token_losses(right, ids)
    wrong_losses = kvlib.next_token_losses(wrong, ids)
    first = FIRST_TOKENS - 1
    return {"loss": float(right_losses.mean()),
            "wrong_pairing_loss": float(wrong_losses.mean()),
            "top1_agreement": float((right.argmax(1) == wrong.argmax(1)).mean()),
            "largest_logit_difference": float(np.abs(right - wrong).max()),
            "first_tokens": FIRST_TOKENS,
            "first_losses": right_losses[:first].round(5).tolist(),
            "first_wrong_pairing_losses": wrong_losses[:first].round(5).tolist()}


def layer_by_layer(params, ids, visit) -> None:
    """kvlib.forward's loop, written out so that each layer's attention weights (h, T, T)
    can be looked at and dropped (all 30 at once would take 1.1 GB): visit(index, weights)."""
    config = params.config
    positions = np.arange(len(ids))
    X = kvlib.embed(np.asarray(ids), params.embedding)
    rotary = kvlib.rotary_positions(config, positions)
    mask = kvlib.causal_mask(len(ids))
    for index, layer in enumerate(params.layers):
        recorded = []
        X = kvlib.decoder_block(X, layer, config.n_heads, mask=mask, record_attention=recorded,
                                rotary=rotary, norm_epsilon=config.norm_epsilon)
        visit(index, recorded[0])


def run_sinks(params, ids) -> dict:
    on_first = np.zeros((params.config.n_layers, params.config.n_heads))

    def visit(index, weights):
        on_first[index] = weights[:, FIRST_QUERY:, 0].mean(axis=1)

    layer_by_layer(params, ids, visit)
    even = float(np.mean(1.0 / (np.arange(FIRST_QUERY, len(ids)) + 1)))
    return {"first_query": FIRST_QUERY, "attention_on_position_0": on_first.round(4).tolist(),
            "even_share": even}


def streaming_forward(params, ids, window: int, sinks: int) -> np.ndarray:
    """Logits with StreamingLLM's positions: a query that has pushed keys out of the window
    sees the sinks as if they sat right before the window (their positions inside the cache),
    not at their original positions. Rotary scores depend on distances only, so the window's
    keys score as usual; only a sink's distance changes, to (sinks + window - 1) - s."""
    config = params.config
    T = len(ids)
    positions = np.arange(T)
    X = kvlib.embed(np.asarray(ids), params.embedding)
    rotary = kvlib.rotary_positions(config, positions)
    at_cache_end = kvlib.rotary_positions(config, np.full(T, sinks + window - 1))
    mask = kvlib.attention_mask(positions, positions, window, sinks)
    evicting = positions >= sinks + window             # queries that see the sinks moved
    for layer in params.layers:
        normed = steps.normalize(X, layer.ln_1_gain, layer.ln_1_bias, config.norm_epsilon)
        Q, K, V = steps.project_qkv(normed, layer)
        Qh = steps.split_heads(rotary.rotate(Q), config.n_heads)
        Kh = steps.split_heads(rotary.rotate(K), config.kv_heads)
        scores = steps.attention_scores(Qh, Kh)
        moved = steps.attention_scores(
            steps.split_heads(at_cache_end.rotate(Q), config.n_heads), Kh[:, :sinks])
        scores[:, evicting, :sinks] = moved[:, evicting]
        weights = steps.softmax(steps.apply_mask(scores, mask))
        heads = steps.weighted_sum(weights, steps.split_heads(V, config.kv_heads))
        H = X + steps.output_projection(steps.merge_heads(heads), layer.Wo, layer.bo)
        X = H + steps.mlp(steps.normalize(H, layer.ln_2_gain, layer.ln_2_bias,
                                          config.norm_epsilon), layer)
    X = steps.normalize(X, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return steps.unembed(X, params.embedding)


def run_windows(params, ids) -> dict:
    rows = []
    for window in WINDOWS:
        for sinks in SINKS:
            windowed = params.with_config(window=window, sink_tokens=sinks)
            rows.append({"window": window, "sinks": sinks, "positions": "original",
                         "loss": loss(windowed, ids)})
        streaming = streaming_forward(params, ids, window, 4)
        rows.append({"window": window, "sinks": 4, "positions": "inside the cache",
                     "loss": float(kvlib.next_token_losses(streaming, ids).mean())})
    return {"rows": rows}


def run_outliers(params, ids) -> dict:
    _, cache = kvlib.prefill(params, ids, last_only=True)
    config, heads = params.config, params.config.kv_heads
    ratios = {"keys": [], "values": []}
    for layer in range(config.n_layers):
        for name, rows in (("keys", cache.keys(layer)), ("values", cache.values(layer))):
            size = np.abs(kvlib.split_heads(rows, heads)).mean(axis=1)       # (kv, dh)
            ratios[name].append((size.max(axis=1) / np.median(size, axis=1)).round(3).tolist())
    return {"largest_over_median": ratios}


KIVI = [("int4", "keys per channel", quantized.PerChannel(4), quantized.PerToken(4)),
        ("int4", "keys per token", quantized.PerToken(4), quantized.PerToken(4)),
        ("int2", "keys per channel", quantized.PerChannel(2), quantized.PerToken(2)),
        ("int2", "keys per token", quantized.PerToken(2), quantized.PerToken(2))]


def run_kivi(params, ids) -> dict:
    plain = kvlib.forward(params, ids)
    rows = []
    for bits, axes, keys, values in KIVI:
        cache = quantized.QuantizedKVCache(params.config, keys=keys, values=values)
        logits = quantized.decoded_logits(params, ids, cache)
        rows.append({"bits": bits, "axes": axes, "keys": keys.name, "values": values.name,
                     "loss": quantized.next_token_loss(logits, ids),
                     "greedy_agreement": quantized.greedy_agreement(logits, plain)})
    return {"plain_loss": quantized.next_token_loss(plain, ids), "rows": rows}


def run_engine(params, ids) -> dict:

    requests = workloads.workload(kvlib.smollm2_tokenizer())
    rows = {}
    for name, make in workloads.variants(params).items():
        result = workloads.run_variant(make(), requests)
        rows[name] = {key: result[key] for key in workloads.STEP_COLUMNS + workloads.PER_STEP}
        rows[name]["outputs"] = result["outputs"]
    outputs = [row.pop("outputs") for row in rows.values()]
    if any(output != outputs[0] for output in outputs):
        raise SystemExit("the variants' outputs differ: the engine is wrong somewhere")
    return {"rows": rows, "outputs": outputs[0]}


FREE_TOKENS = 48
KIVI_FREE_PROMPTS = (
    "Give me three tips for learning to cook, with a sentence on each.",
    "Write a short story about a robot who learns to paint.",
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a word is a palindrome, and explain it.",
)


def chat_ids(tokenizer, text: str) -> list[int]:
    """A user's request as SmolLM2 reads it: the chat template, the assistant's turn open."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def agreement(tokens, reference) -> dict:
    """How far two greedy continuations go together: the tokens before the first
    difference, and the fraction of positions equal."""
    same = [a == b for a, b in zip(tokens, reference)]
    return {"matching_prefix": same.index(False) if False in same else len(same),
            "fraction_equal": float(np.mean(same))}


def run_kivi_free(params, ids) -> dict:
    tokenizer = kvlib.smollm2_tokenizer()
    prompts = []
    for text in KIVI_FREE_PROMPTS:
        prompt = chat_ids(tokenizer, text)
        plain = quantized.greedy_tokens(params, prompt, FREE_TOKENS,
                                        kvlib.make_cache(params.config))
        if plain != kvlib.generate(params, prompt, FREE_TOKENS):
            raise SystemExit("greedy_tokens with a plain cache is not kvlib.generate")
        rows = []
        for bits, axes, keys, values in KIVI:
            cache = quantized.QuantizedKVCache(params.config, keys=keys, values=values)
            tokens = quantized.greedy_tokens(params, prompt, FREE_TOKENS, cache)
            rows.append({"bits": bits, "axes": axes, "tokens": tokens} |
                        agreement(tokens, plain))
        prompts.append({"text": text, "prompt_length": len(prompt), "plain": plain,
                        "rows": rows})
    return {"new_tokens": FREE_TOKENS, "prompts": prompts}


LONG_TOKENS = 12_288
LONG_BUCKET = 512


def bucket_losses(params, ids: list[int]) -> list[float]:
    """Mean next-token loss of ids in buckets of LONG_BUCKET: one chunked prefill, one cache."""
    cache = kvlib.make_cache(params.config)
    losses = []
    for start in range(0, len(ids) - 1, LONG_BUCKET):
        chunk = ids[start:start + LONG_BUCKET + 1]
        logits, cache = kvlib.prefill(params, chunk[:-1], cache)
        # a last row that predicts nothing, as next_token_losses wants one row a token
        rows = np.vstack([logits, logits[-1:]])
        losses.append(float(kvlib.next_token_losses(rows, chunk).mean()))
        print(f"  positions {start}-{start + LONG_BUCKET - 1}: {losses[-1]:.3f}", flush=True)
    return [round(loss, 6) for loss in losses]


def run_long(params, ids) -> dict:
    tokenizer = kvlib.smollm2_tokenizer()
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    long_ids = tokenizer.encode(text)[:LONG_TOKENS + 1]
    if len(long_ids) <= LONG_TOKENS:
        raise SystemExit(f"the text has only {len(long_ids)} tokens")
    trained = params.config.context_length
    stretched = params.with_config(context_length=LONG_TOKENS + 1)
    # the same tokens again, the run started LONG_TOKENS - trained tokens later: what sat past
    # the trained length now sits inside it (with 4,096 tokens less text before it)
    later = LONG_TOKENS - trained
    return {"trained_context": trained, "bucket": LONG_BUCKET, "tokens": LONG_TOKENS,
            "ids_prefix": long_ids[:1024] == ids,
            "bucket_losses": bucket_losses(stretched, long_ids),
            "later_start": later,
            "later_bucket_losses": bucket_losses(params, long_ids[later:])}


HEADS_SENTENCE = ("Alan Turing was born in London in 1912, and he studied mathematics at "
                  "Cambridge.")


def run_heads(params, ids) -> dict:
    from kvlib import heads

    tokenizer = kvlib.smollm2_tokenizer()
    half = tokenizer.encode(HEADS_SENTENCE)
    twice = half + half
    recorded: list = []
    logits = kvlib.forward(params, twice, record_attention=recorded)
    previous = heads.previous_token_scores(recorded)              # (30 layers, 9 heads)
    induction = heads.induction_scores(recorded, len(half))        # (30, 9)
    return {"sentence": HEADS_SENTENCE, "half_length": len(half),
            "previous": np.round(previous, 6).tolist(),
            "induction": np.round(induction, 6).tolist(),
            "copied": heads.copied_fraction(logits, twice, len(half))}


KERNELS = ("Haswell", "SkylakeX", "Sandybridge", "Prescott")
KERNEL_TOKENS = 8


def sky_runs(params) -> dict:
    """The sky's first KERNEL_TOKENS tokens, plain and with int4 keys per channel, in this
    process (its OpenBLAS kernel), and the plain run's smallest top-two gap."""
    tokenizer = kvlib.smollm2_tokenizer()
    prompt = chat_ids(tokenizer, KIVI_FREE_PROMPTS[2])
    plain = quantized.greedy_tokens(params, prompt, KERNEL_TOKENS,
                                    kvlib.make_cache(params.config))
    int4 = quantized.greedy_tokens(params, prompt, KERNEL_TOKENS, quantized.QuantizedKVCache(
        params.config, quantized.PerChannel(4, 32), quantized.PerToken(4)))
    logits = kvlib.forward(params, prompt + plain)[len(prompt) - 1:-1]     # each pick's row
    top_two = np.sort(logits, axis=-1)[:, -2:]
    return {"plain": plain, "int4 keys per channel": int4,
            "plain_smallest_gap": float((top_two[:, 1] - top_two[:, 0]).min())}


def run_kernels(params, ids) -> dict:
    import subprocess

    runs = {}
    for kernel in KERNELS:
        done = subprocess.run([sys.executable, __file__, "--sky-runs"], capture_output=True,
                              text=True, check=True,
                              env=os.environ | {"OPENBLAS_CORETYPE": kernel})
        runs[kernel] = json.loads(done.stdout)
    return {"prompt": KIVI_FREE_PROMPTS[2], "new_tokens": KERNEL_TOKENS, "runs": runs}


PASSAGE = ("The KV cache keeps the keys and values of every earlier token, so that a decode "
           "step computes only the new token's row. Its size grows with the number of layers, "
           "the number of K/V heads, the head size and the length of the sequence. Serving "
           "engines store it in blocks, share the blocks of a common prefix, and quantize it "
           "when memory is short.")
FUNCTION = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)"""
SPECULATIVE_PROMPTS = {
    "repeat a passage": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "fix a function": "This Python function fails on an empty list. Fix it and show the "
                      f"whole function:\n\n{FUNCTION}",
    "three tips": KIVI_FREE_PROMPTS[0],
    "a short story": KIVI_FREE_PROMPTS[1],
}
SPECULATION_LENGTHS = (2, 4, 8)
EXITS = (4, 8, 12, 16, 20, 24, 26, 28, 29)
SELF_DRAFT_EXITS = (15, 27)


def run_stats(decoder) -> dict:
    """A finished SpeculativeDecoder's counts, and every round's proposals and acceptances."""
    stats = decoder.stats()
    return {"rounds": stats.rounds, "proposed": stats.proposed, "judged": stats.judged,
            "accepted": stats.accepted, "new_tokens": stats.new_tokens,
            "proposals_per_round": [len(step.proposals) for step in decoder.steps],
            "accepted_per_round": [step.accepted for step in decoder.steps]}


def run_speculative(params, ids) -> dict:
    tokenizer = kvlib.smollm2_tokenizer()
    prompts = {}
    for name, text in SPECULATIVE_PROMPTS.items():
        prompt = chat_ids(tokenizer, text)
        reference = kvlib.generate(params, prompt, FREE_TOKENS)
        lookup = {}
        for k in SPECULATION_LENGTHS:
            decoder = speculative.SpeculativeDecoder(
                params, speculative.PromptLookupDrafter(), prompt, k)
            if decoder.generate(FREE_TOKENS) != reference:
                raise SystemExit(f"prompt lookup changed the greedy output ({name}, k={k})")
            lookup[k] = run_stats(decoder)
        exits = {n: speculative.greedy_agreements(params, params.first_layers(n), prompt,
                                                  reference)
                 for n in sorted(set(EXITS) | set(SELF_DRAFT_EXITS))}
        self_drafts = {}
        for n in SELF_DRAFT_EXITS:
            self_drafts[n] = {}
            for k in SPECULATION_LENGTHS:
                decoder = speculative.SpeculativeDecoder(params, params.first_layers(n),
                                                         prompt, k)
                if decoder.generate(FREE_TOKENS) != reference:
                    raise SystemExit(f"self-speculation changed the greedy output ({name}, "
                                     f"{n} layers, k={k})")
                if [s.accepted for s in decoder.steps] != \
                        speculative.replay_greedy(exits[n], k):
                    raise SystemExit(f"self-speculation's rounds are not replay_greedy's "
                                     f"({name}, {n} layers, k={k})")
                self_drafts[n][k] = run_stats(decoder)
        prompts[name] = {
            "text": text, "prompt_length": len(prompt), "reference": reference,
            "lookup": lookup,
            "agreements": {n: agreements.astype(int).tolist()
                           for n, agreements in exits.items()},
            "self_draft": self_drafts}
    return {"new_tokens": FREE_TOKENS, "lookup": {"max_ngram": 3, "min_ngram": 1},
            "prompts": prompts}


PARTS = {"pairing": run_pairing, "sinks": run_sinks, "windows": run_windows,
         "outliers": run_outliers, "kivi": run_kivi, "engine": run_engine,
         "kivi_free": run_kivi_free, "kernels": run_kernels, "heads": run_heads, "long": run_long,
         "speculative": run_speculative}


def main(argv: list[str]) -> None:
    if argv == ["--sky-runs"]:              # one kernel's runs, for run_kernels
        print(json.dumps(sky_runs(kvlib.load_smollm2())))
        return
    unknown = set(argv) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {sorted(PARTS)}")
    params, tokenizer = kvlib.load_smollm2(), kvlib.smollm2_tokenizer()
    ids = text_ids(tokenizer)
    path = smollm2.MEASURED
    measured = json.loads(path.read_text()) if path.is_file() else {}
    if measured.get("ids", ids) != ids:
        raise SystemExit("this Python's pydoc_data gives other tokens than the kept ones: "
                         "remove the file to measure everything again")
    measured |= {"text": "pydoc_data.topics, sorted topics joined by blank lines, first "
                         f"{N_TOKENS} tokens", "ids": ids,
                 "command": "python tools/measure_smollm2.py [parts]"}
    for name in argv or list(PARTS):
        started = time.monotonic()
        result = PARTS[name](params, ids)
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
        if path.is_file():          # read again: another run may have written a part since
            measured = json.loads(path.read_text()) | {key: measured[key] for key in
                                                       ("text", "ids", "command")}
        measured[name] = result
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
