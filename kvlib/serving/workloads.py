"""Workloads for the serving lessons and their benchmarks: the batching lesson's seeded stream
of requests (make_workload), and the engine lesson's chat requests to SmolLM2 (a shared system
message, questions arriving over six steps, one long passage) and the same questions with
replies past Gemma 3's window (long_reply_workload), how they arrive at an engine,
the engine variants the lesson compares, and what a run measures.

The lesson (the_engine), the batching lesson, benchmarks/engine.py, benchmarks/
smollm2_batching.py and tools/measure_smollm2.py all serve the chat workload.
"""

from __future__ import annotations

import numpy as np

from ..checks import as_count, as_real_number, as_whole_number, as_whole_numbers
from .engine import Engine, SamplingParams, StaticBatchingEngine, summarize
from .request import Request, requests_of_lengths


def make_workload(n_requests: int = 12, seed: int = 0, mean_gap: float = 2.0,
                  prompt_lengths=(4, 16), output_lengths=(2, 20)) -> tuple[Request, ...]:
    """A seeded stream of requests (batched_decoding): arrivals a random number of steps apart
    (exponential gaps of mean mean_gap, rounded down to whole steps: a Poisson stream), the
    first at step 0; prompt and output lengths uniform between their (shortest, longest),
    prompts seeded random ids of the toy's vocabulary. The same seed gives the same requests."""
    n_requests, seed = as_count("n_requests", n_requests, 1), as_whole_number("seed", seed, 0)
    mean_gap = as_real_number("mean_gap", mean_gap, minimum=0)
    (low_p, high_p), (low_o, high_o) = (as_whole_numbers(name, bounds, 1) for name, bounds in
                                        (("prompt_lengths", prompt_lengths),
                                         ("output_lengths", output_lengths)))
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(mean_gap, n_requests) if mean_gap > 0 else np.zeros(n_requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int).tolist()
    prompts = rng.integers(low_p, high_p + 1, n_requests)
    outputs = rng.integers(low_o, high_o + 1, n_requests)
    return tuple(requests_of_lengths(prompts, outputs, arrivals, seed))


def arrivals_in_seconds(requests, seconds_per_step: float) -> list[Request]:
    """The requests with their arrival steps turned into seconds (batched_decoding's benchmark):
    arrival x seconds_per_step, so that a workload keeps its shape on a clock of seconds."""
    seconds_per_step = as_real_number("seconds_per_step", seconds_per_step, positive=True)
    return [r.fresh(arrival=r.arrival * seconds_per_step) for r in requests]


SYSTEM_PROMPT = ("You are a patient tutor. Answer in one short sentence, with a number when "
                 "the question asks for one.")
PASSAGE = ("Read this and answer. The printing press with movable metal type was built by "
           "Johannes Gutenberg in Mainz around 1450. Before it, books were copied by hand, and "
           "a single Bible could take a scribe three years. Gutenberg's press could print "
           "hundreds of pages a day. Within fifty years, printing shops had spread to more than "
           "two hundred cities in Europe, and millions of books had been printed. Cheaper books "
           "helped more people learn to read, and ideas travelled faster than ever before. "
           "Question: who built the press, and where?")
QUESTIONS = ["What is 7 times 8?", "Name a planet.", "What is the capital of Japan?",
             "How many legs has a spider?", "What colour is the sky?", "Say hello in French.",
             PASSAGE, "Who wrote Hamlet?"]
ARRIVALS = [0, 0, 0, 0, 3, 4, 5, 6]
"""The step at which each question arrives: four at once, then one a step; the sixth (the
passage, a long prompt) arrives while the others decode."""
MAX_TOKENS = [6, 14, 8, 12, 6, 10, 8, 12]
"""Each request's max_tokens: replies of different lengths, as in real traffic."""
END_OF_TURN = 2
"""SmolLM2's <|im_end|>: a reply stops there."""
def chat_prompts(tokenizer, questions=QUESTIONS, system: str = SYSTEM_PROMPT) -> list[list[int]]:
    """Each question as a chat request with the same system message: token ids."""
    return [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": question}])
            for question in questions]


LONG_REPLIES = [600, 900, 700, 1200, 800, 1000, 1500, 650]
"""max_tokens of each question in the long-reply workload: replies that go past Gemma 3's
window of 512 positions (a long chat), as in the chat workload's arrivals."""


def long_reply_workload(tokenizer, max_tokens=LONG_REPLIES) -> list[tuple[int, list[int],
                                                                           SamplingParams]]:
    """The chat workload's questions as plain-text prompts for a base model (Gemma 3 270M has
    no chat template): the system message, then "Question: ...\nAnswer:", each with a long
    reply (max_tokens) and no stop token, arriving as the chat workload's do -> [(arrival
    step, prompt ids, SamplingParams)]. What local_and_global_layers measures the pool on:
    lengths past the window, a shared prefix."""
    max_tokens = as_whole_numbers("max_tokens", max_tokens, 1).tolist()
    if len(max_tokens) != len(QUESTIONS):
        raise ValueError(f"give max_tokens for each of the {len(QUESTIONS)} questions, got "
                         f"{len(max_tokens)}")
    return [(arrival, tokenizer.encode(f"{SYSTEM_PROMPT}\n\nQuestion: {question}\nAnswer:"),
             SamplingParams(max_tokens=n))
            for arrival, question, n in zip(ARRIVALS, QUESTIONS, max_tokens)]


def workload(tokenizer) -> list[tuple[int, list[int], SamplingParams]]:
    """The lesson's workload: (arrival step, prompt ids, SamplingParams) for each question."""
    return [(arrival, prompt, SamplingParams(max_tokens=n, stop_token_ids=(END_OF_TURN,)))
            for arrival, prompt, n in zip(ARRIVALS, chat_prompts(tokenizer), MAX_TOKENS)]


def add_arrivals(engine: Engine, requests, ids: list[int]) -> None:
    """Add every request whose arrival step has come (ids grows with their ids)."""
    while len(ids) < len(requests) and requests[len(ids)][0] <= engine.step_count:
        _, prompt, sampling = requests[len(ids)]
        ids.append(engine.add_request(prompt, sampling))


STEP_COLUMNS = ("steps", "ttft_steps", "decode_stall", "tokens_per_step", "largest_step",
                "preemptions", "computed_prompt_tokens")
"""What run_variant measures in steps and tokens: the same on every machine. (Time per output
token is left out: counted in steps it is 1 for every request that is never preempted, since
continuous batching gives every running request a token in every step; decode_stall says
what a step cost the requests decoding in it.)"""
PER_STEP = ("step_tokens", "step_decodes")
"""What run_variant records step by step: the tokens each step computed, and how many
requests got their next token (decoded) in it."""


def variants(params) -> dict:
    """The engine and the variants the lesson compares, each a function that makes a fresh
    engine, each changing one thing of the row it is compared with: the engine (blocks of 16,
    48 in the pool, a budget of 64 tokens a step), without prefix caching, with a pool of 14
    blocks; without chunked prefill (its budget must hold the longest prompt, 148 tokens, as
    vLLM requires max_num_batched_tokens >= max_model_len without it: 192); and static
    batching, which is that row with static admission."""
    common = {"block_size": 16, "n_blocks": 48}
    return {
        "the engine": lambda: Engine(params, max_num_batched_tokens=64, **common),
        "without prefix caching": lambda: Engine(params, max_num_batched_tokens=64,
                                                 enable_prefix_caching=False, **common),
        "without chunked prefill": lambda: Engine(params, max_num_batched_tokens=192,
                                                  enable_chunked_prefill=False, **common),
        "static batching": lambda: StaticBatchingEngine(params, max_num_batched_tokens=192,
                                                        **common),
        "a pool too small (14 blocks)": lambda: Engine(params, block_size=16, n_blocks=14,
                                                       max_num_batched_tokens=64),
    }


def workload_table(results: dict[str, dict]) -> str:
    """The variants side by side: one row each, the service numbers in steps and tokens."""
    lines = [f"{'':30s} {'steps':>5s} {'TTFT':>5s} {'decode stall':>12s} {'tokens/step':>11s} "
             f"{'largest step':>12s} {'preempted':>9s} {'prompt tokens run':>17s}"]
    for name, row in results.items():
        lines.append(f"{name:30s} {row['steps']:5d} {row['ttft_steps']:5.1f} "
                     f"{row['decode_stall']:12d} {row['tokens_per_step']:11.2f} "
                     f"{row['largest_step']:12d} {row['preemptions']:9d} "
                     f"{row['computed_prompt_tokens']:17d}")
    return "\n".join(lines)


def run_variant(engine: Engine, requests) -> dict:
    """Run the workload [(arrival step, prompt, SamplingParams)] on one engine to the end ->
    summarize's numbers, with the preemptions, the prompt tokens that had to be computed (not
    taken from the prefix cache), the largest step, the decode stall (the most tokens computed
    in a step in which some request decoded: what that request waited for to get one token),
    step by step the tokens computed and the requests that decoded (PER_STEP), and each
    request's output."""
    ids: list[int] = []
    step_tokens, step_decodes = [], []
    add_arrivals(engine, requests, ids)
    while engine.has_unfinished_requests() or len(ids) < len(requests):
        engine.step()
        step_tokens.append(sum(engine.last_step.scheduled_tokens.values()))
        step_decodes.append(len(engine.last_step.decodes))
        add_arrivals(engine, requests, ids)
    numbers = summarize(engine, ids)
    numbers["preemptions"] = engine.stats["preemptions"]
    numbers["computed_prompt_tokens"] = engine.stats["prompt_tokens"] - \
        engine.stats["prefix_hit_tokens"]
    numbers["largest_step"] = max(step_tokens)
    numbers["decode_stall"] = max((tokens for tokens, decodes in zip(step_tokens, step_decodes)
                                   if decodes), default=0)
    numbers["step_tokens"], numbers["step_decodes"] = step_tokens, step_decodes
    numbers["outputs"] = [engine.requests[i].output_token_ids for i in ids]
    return numbers
