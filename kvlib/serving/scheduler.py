"""Which requests run in each step (batched_decoding): static batching against continuous batching.

A server receives requests at any time, each with a prompt and a number of tokens to generate.
Every step of the model runs one batch: the requests admitted in that step are prefilled (their
prompt in one pass, which gives their first token), the others already in the batch decode one
token each (kvlib.serving.batch). A request leaves the batch when its last token is out.

- StaticBatching: a batch is formed from the waiting requests, then runs until every request
  in it has finished; the next batch waits. A request that finishes early leaves its slot empty
  until the longest one is done, and a request that arrives meanwhile waits for all of them.
- ContinuousBatching: the batch is re-formed every step; a finished request leaves at once and
  a waiting one takes its slot in the next step (iteration-level scheduling, Orca: Yu et al.,
  OSDI 2022; "in-flight batching" in TensorRT-LLM and TGI; vLLM's scheduler).

Both admit waiting requests first come, first served, within two limits per step: max_batch
sequences (vLLM's --max-num-seqs) and, optionally, max_batched_tokens tokens (vLLM's
--max-num-batched-tokens: a prefill counts its whole prompt, a decode one token). Admission
stops at the first waiting request that does not fit: no later request overtakes it (vLLM
does the same with chunked prefill off; with chunked prefill it would prefill the part of
the prompt that fits, which kvlib does not implement).

serve() runs a policy on a list of requests and returns the Timeline of its steps. Time is
counted in model steps by default, so every number is exact and the same on every machine;
given an `execute` function that runs a step with a real model and returns its seconds
(ModelRunner), the same loop runs on a clock of seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from numbers import Integral, Real

import numpy as np

from ..cache import KVCache
from ..checks import count, real_number, whole_number
from ..inference import prefill
from ..params import Params
from .batch import attend_per_sequence, batched_decode_step

# ------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Request:
    """One request (batched_decoding): it arrives at `arrival` (a model step, or seconds), brings
    a prompt of prompt_length tokens and wants output_length new tokens (the first comes
    from its prefill, each other one from a decode step)."""

    id: int
    arrival: float
    prompt_length: int
    output_length: int

    def __post_init__(self):
        whole_number("Request.id", self.id, 0)
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, Real):
            raise ValueError(f"Request.arrival must be a time >= 0, got {self.arrival!r}")
        real_number("Request.arrival", self.arrival, minimum=0)
        whole_number("Request.prompt_length", self.prompt_length, 1)
        whole_number("Request.output_length", self.output_length, 1)

    def arriving_at(self, arrival: float) -> Request:
        """The same request, arriving at another time."""
        return replace(self, arrival=arrival)


def arrivals_in_seconds(requests, seconds_per_step: float) -> tuple[Request, ...]:
    """The requests with their arrival steps turned into seconds (batched_decoding's benchmark):
    arrival x seconds_per_step, so that a workload keeps its shape on a clock of seconds."""
    requests = _check_requests(requests)
    if isinstance(seconds_per_step, bool) or not isinstance(seconds_per_step, Real):
        raise ValueError(f"seconds_per_step must be a positive number, got {seconds_per_step!r}")
    real_number("seconds_per_step", seconds_per_step, positive=True)
    return tuple(r.arriving_at(r.arrival * float(seconds_per_step)) for r in requests)


def _check_range(name: str, bounds) -> tuple[int, int]:
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"{name} must be (shortest, longest), got {bounds!r}")
    low, high = (whole_number(f"{name}'s bounds", value, 1) for value in bounds)
    if low > high:
        raise ValueError(f"{name} must be (shortest, longest) with shortest <= longest, "
                         f"got {bounds!r}")
    return low, high


def make_workload(n_requests: int = 12, seed: int = 0, mean_gap: float = 2.0,
                  prompt_lengths=(4, 16), output_lengths=(2, 20)) -> tuple[Request, ...]:
    """A seeded stream of requests (batched_decoding): arrivals a random number of steps apart
    (exponential gaps of mean mean_gap, rounded down to whole steps: a Poisson stream), the
    first at step 0; prompt and output lengths uniform between their (shortest, longest).
    The same seed gives the same requests."""
    n_requests = count("n_requests", n_requests, 1)
    seed = whole_number("seed", seed, 0)
    if isinstance(mean_gap, bool) or not isinstance(mean_gap, Real) \
            or not 0 <= real_number("mean_gap", mean_gap) <= 1e6:
        raise ValueError(f"mean_gap must be a number of steps between 0 and 1e6, "
                         f"got {mean_gap!r}")
    prompts, outputs = _check_range("prompt_lengths", prompt_lengths), \
        _check_range("output_lengths", output_lengths)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(float(mean_gap), n_requests) if mean_gap > 0 else \
        np.zeros(n_requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    prompt_draws = rng.integers(prompts[0], prompts[1] + 1, n_requests)
    output_draws = rng.integers(outputs[0], outputs[1] + 1, n_requests)
    return tuple(Request(i, int(a), int(p), int(o))
                 for i, (a, p, o) in enumerate(zip(arrivals, prompt_draws, output_draws)))


def _check_requests(requests) -> tuple[Request, ...]:
    if isinstance(requests, Request):
        requests = [requests]
    if not isinstance(requests, (list, tuple)) or not requests:
        raise ValueError("requests must be a non-empty list of kvlib.serving.Request")
    for item in requests:
        if not isinstance(item, Request):
            raise TypeError(f"requests must be kvlib.serving.Request objects, got "
                            f"{type(item).__name__}")
    ids = [request.id for request in requests]
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"request ids must be unique; {twice} appear more than once")
    return tuple(requests)


# ------------------------------------------------------------------------------ policies


def first_come_first_served(waiting, free_slots: int, token_budget: int | None) -> list:
    """The waiting requests that enter now (batched_decoding): in order of arrival (then id), as
    many as free_slots allows and, with a token budget, as long as their prompts fit in it.
    Stops at the first that does not fit: a later request never overtakes it."""
    waiting = _request_list("waiting", waiting)
    free_slots = whole_number("free_slots", free_slots, 0)
    if token_budget is not None:
        token_budget = whole_number("token_budget", token_budget, 0)
    admitted = []
    for request in sorted(waiting, key=lambda r: (r.arrival, r.id)):
        if len(admitted) == free_slots:
            break
        if token_budget is not None:
            if request.prompt_length > token_budget:
                break
            token_budget -= request.prompt_length
        admitted.append(request)
    return admitted


def _request_list(name: str, requests) -> list:
    """A list (possibly empty) of scheduler Requests."""
    if not isinstance(requests, (list, tuple)) or \
            not all(isinstance(request, Request) for request in requests):
        raise TypeError(f"{name} must be a list of kvlib.serving.scheduler.Request, got "
                        f"{requests!r:.80}")
    return list(requests)


class _Policy:
    name = ""

    def __init__(self, max_batch: int = 4, max_batched_tokens: int | None = None):
        self.max_batch = whole_number("max_batch", max_batch, 1)
        if max_batched_tokens is not None:
            max_batched_tokens = whole_number("max_batched_tokens", max_batched_tokens, 1)
            if max_batched_tokens < self.max_batch:
                raise ValueError(f"max_batched_tokens ({max_batched_tokens}) must be at least "
                                 f"max_batch ({self.max_batch}): a full batch of decodes "
                                 "needs one token each (vLLM refuses this too)")
        self.max_batched_tokens = max_batched_tokens

    def __repr__(self) -> str:
        tokens = "" if self.max_batched_tokens is None else \
            f", max_batched_tokens={self.max_batched_tokens}"
        return f"{type(self).__name__}(max_batch={self.max_batch}{tokens})"

    def admit(self, waiting, running) -> list:
        raise NotImplementedError


class StaticBatching(_Policy):
    """Form a batch only when the previous one has finished entirely (batched_decoding): up to
    max_batch waiting requests, first come first served, then none until all are done.
    transformers' generate on a list of prompts is this: one batch, run to its end."""

    name = "static"

    def admit(self, waiting, running) -> list:
        if _request_list("running", running):
            return []
        return first_come_first_served(waiting, self.max_batch, self.max_batched_tokens)


class ContinuousBatching(_Policy):
    """Re-form the batch every step (batched_decoding; Orca's iteration-level scheduling): finished
    requests leave after their last token, and waiting requests fill the free slots in the
    next step, first come first served. Each running request's decode takes one token of
    the step's budget."""

    name = "continuous"

    def admit(self, waiting, running) -> list:
        free = self.max_batch - len(_request_list("running", running))
        budget = None if self.max_batched_tokens is None else \
            self.max_batched_tokens - len(running)
        return first_come_first_served(waiting, free, budget)


# ------------------------------------------------------------------------------ the timeline


@dataclass(frozen=True)
class Step:
    """One model step (batched_decoding): from start to end; `admitted` were prefilled in it (and
    got their first token), `decoded` got one more token each, `finished` left after it."""

    index: int
    start: float
    end: float
    admitted: tuple[int, ...]
    decoded: tuple[int, ...]
    finished: tuple[int, ...]

    @property
    def batch(self) -> tuple[int, ...]:
        """Every request in the step: the admitted and the decoded."""
        return self.admitted + self.decoded

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """What serve() did (batched_decoding): its steps, and for every request when it arrived, was
    admitted, got its first token and finished. Times are in the unit of the requests'
    arrivals: model steps, or seconds.

    time_to_first_token (TTFT): first token - arrival, the wait plus the prefill step.
    time_per_output_token (TPOT): (finish - first token) / (output_length - 1), the time
    between two tokens once the first is out (undefined for a single-token request).
    throughput: output tokens / (last finish - first arrival).
    """

    def __init__(self, requests, steps, policy):
        self.requests = {request.id: request for request in requests}
        self.steps = tuple(steps)
        self.policy = policy
        self.admitted_step, self.first_token, self.finish = {}, {}, {}
        for step in self.steps:
            for i in step.admitted:
                self.admitted_step[i] = step.index
                self.first_token[i] = step.end
            for i in step.finished:
                self.finish[i] = step.end

    def __repr__(self) -> str:
        return (f"Timeline({self.policy.name}: {len(self.requests)} requests in "
                f"{len(self.steps)} steps)")

    def _request(self, request_id) -> int:
        if isinstance(request_id, (bool, np.bool_)) or not isinstance(request_id, Integral) \
                or request_id not in self.requests:
            raise ValueError(f"request_id must be the id of one of this timeline's requests "
                             f"{sorted(self.requests)}, got {request_id!r}")
        return int(request_id)

    def admitted_at(self, request_id: int) -> float:
        """When the request's prefill step started."""
        return self.steps[self.admitted_step[self._request(request_id)]].start

    def time_to_first_token(self, request_id: int) -> float:
        request_id = self._request(request_id)
        return self.first_token[request_id] - self.requests[request_id].arrival

    def time_per_output_token(self, request_id: int) -> float | None:
        request_id = self._request(request_id)
        request = self.requests[request_id]
        if request.output_length == 1:
            return None
        return (self.finish[request_id] - self.first_token[request_id]) / \
            (request.output_length - 1)

    def latency(self, request_id: int) -> float:
        """From arrival to the last token."""
        request_id = self._request(request_id)
        return self.finish[request_id] - self.requests[request_id].arrival

    @property
    def makespan(self) -> float:
        """From the first arrival to the last token."""
        first = min(request.arrival for request in self.requests.values())
        return self.steps[-1].end - first

    @property
    def output_tokens(self) -> int:
        return sum(request.output_length for request in self.requests.values())

    @property
    def throughput(self) -> float:
        """Output tokens per unit of time (per step, or per second)."""
        return self.output_tokens / self.makespan

    @property
    def occupancy(self) -> np.ndarray:
        """Requests in the batch at each step: (n_steps,) ints, at most max_batch."""
        return np.array([len(step.batch) for step in self.steps], dtype=int)

    @property
    def mean_occupancy(self) -> float:
        """The mean share of the max_batch slots in use, over the steps that ran."""
        return float(self.occupancy.mean() / self.policy.max_batch)

    def summary(self) -> dict:
        """The numbers that compare two policies, on two clocks: the steps run (passes of the
        model, the work) and the makespan (first arrival to last token, idle steps
        included); throughput is output tokens per unit of the makespan, tokens_per_step_run
        per step run. Then the mean occupancy, the mean and the worst TTFT, the mean TPOT
        and the mean latency."""
        ids = sorted(self.requests)
        ttft = np.array([self.time_to_first_token(i) for i in ids], dtype=float)
        tpot = [self.time_per_output_token(i) for i in ids]
        tpot = np.array([t for t in tpot if t is not None], dtype=float)
        return {"steps": len(self.steps), "makespan": self.makespan,
                "throughput": self.throughput,
                "tokens_per_step_run": self.output_tokens / len(self.steps),
                "mean_occupancy": self.mean_occupancy,
                "mean_ttft": float(ttft.mean()), "max_ttft": float(ttft.max()),
                "mean_tpot": float(tpot.mean()) if tpot.size else float("nan"),
                "mean_latency": float(np.mean([self.latency(i) for i in ids]))}

    def state_at(self, time_now: float) -> dict[int, str]:
        """Each request's state at a time (batched_decoding's widget): 'not arrived', 'waiting',
        'running' or 'finished'."""
        time_now = _time(time_now)
        states = {}
        for i, request in self.requests.items():
            if time_now < request.arrival:
                states[i] = "not arrived"
            elif time_now < self.admitted_at(i):
                states[i] = "waiting"
            elif time_now < self.finish[i]:
                states[i] = "running"
            else:
                states[i] = "finished"
        return states

    def step_at(self, time_now: float) -> Step | None:
        """The step running at a time, or None (before the first, after the last, idle)."""
        time_now = _time(time_now)
        for step in self.steps:
            if step.start <= time_now < step.end:
                return step
        return None


def _time(time_now) -> float:
    if isinstance(time_now, (bool, np.bool_)) or not isinstance(time_now, Real):
        raise TypeError(f"time_now must be a time (a number, in the unit of the requests' "
                        f"arrivals), got {time_now!r}")
    return real_number("time_now", time_now)


def serve(requests, policy: _Policy, execute=None) -> Timeline:
    """Run a policy over requests, step by step (batched_decoding) -> Timeline.

    Each step: the requests that have arrived join the waiting queue; the policy admits some
    of them; the step runs (the admitted are prefilled, the others decode one token); those
    whose last token is out leave. With nothing to run, the clock jumps to the next arrival.
    execute(admitted, decoded), given the two lists of Requests, runs the step (ModelRunner);
    the step lasts what it returns, or one model step when it returns None (or without one):
    serve(..., execute=runner) runs on a clock of measured seconds, serve(...,
    execute=runner.step) runs the model on the clock of model steps.
    """
    requests = _check_requests(requests)
    if not isinstance(policy, _Policy):
        raise TypeError(f"policy must be StaticBatching(...) or ContinuousBatching(...), got "
                        f"{type(policy).__name__}")
    if execute is not None and not callable(execute):
        raise TypeError(f"execute must be a function execute(admitted, decoded) (ModelRunner) "
                        f"or None, got {execute!r}")
    budget = policy.max_batched_tokens
    too_long = [r.id for r in requests if budget is not None and r.prompt_length > budget]
    if too_long:
        raise ValueError(f"the prompts of requests {too_long} are longer than "
                         f"max_batched_tokens ({budget}): they could never be prefilled in one "
                         "step (vLLM refuses such a setting unless chunked prefill splits the "
                         "prompt)")
    pending = sorted(requests, key=lambda r: (r.arrival, r.id))
    waiting, running, produced, steps = [], [], {}, []
    clock = 0.0
    while pending or waiting or running:
        while pending and pending[0].arrival <= clock:
            waiting.append(pending.pop(0))
        if not waiting and not running:
            clock = float(pending[0].arrival)
            continue
        admitted = policy.admit(list(waiting), list(running))
        if not admitted and not running:
            raise RuntimeError("the policy admitted nothing with an empty batch: it would "
                               "wait for ever")
        for request in admitted:
            waiting.remove(request)
        decoded = list(running)
        duration = None if execute is None else execute(list(admitted), decoded)
        duration = 1.0 if duration is None else duration
        if isinstance(duration, bool) or not isinstance(duration, Real) or not duration > 0 \
                or not math.isfinite(duration):
            raise ValueError(f"execute must return the step's duration, a positive number, "
                             f"got {duration!r}")
        for request in admitted:
            produced[request.id] = 1
        for request in decoded:
            produced[request.id] += 1
        running = decoded + admitted
        finished = [r for r in running if produced[r.id] == r.output_length]
        running = [r for r in running if produced[r.id] < r.output_length]
        duration = float(duration)
        steps.append(Step(len(steps), clock, clock + duration, tuple(r.id for r in admitted),
                          tuple(r.id for r in decoded), tuple(r.id for r in finished)))
        clock += duration
    return Timeline(requests, steps, policy)


# ------------------------------------------------------------------------------ with a model


def random_prompts(requests, vocab_size: int, seed: int = 0) -> dict[int, list[int]]:
    """Seeded token ids for every request's prompt (batched_decoding): {id: prompt_length ids}."""
    requests = _check_requests(requests)
    vocab_size = count("vocab_size", vocab_size, 1)
    rng = np.random.default_rng(whole_number("seed", seed, 0))
    return {r.id: rng.integers(0, vocab_size, r.prompt_length).tolist() for r in requests}


class ModelRunner:
    """Runs serve()'s steps with a model (batched_decoding): each admitted request is prefilled
    into its own cache (kvlib.prefill; its first token), the requests already running decode
    one token each in one batched_decode_step. Greedy tokens; `outputs[id]` collects them.
    Calling it runs a step and returns the seconds it took (time.perf_counter); step() runs it
    and returns None, so that serve() counts it as one model step.

    prompts: {request id: token ids}. make_cache(request) gives an empty cache for a
    request; by default a KVCache just large enough for its prompt and output. A
    request's cache is dropped when its last token is out.
    """

    def __init__(self, params: Params, prompts: Mapping, *, attend=attend_per_sequence,
                 make_cache=None):
        if not isinstance(params, Params):
            raise TypeError(f"params must be kvlib Params, got {type(params).__name__}")
        if not isinstance(prompts, Mapping):
            raise TypeError("prompts must be a dict {request id: token ids}")
        if not callable(attend) or (make_cache is not None and not callable(make_cache)):
            raise TypeError("attend and make_cache must be functions (make_cache may be None)")
        self.params, self.prompts, self.attend = params, dict(prompts), attend
        self.make_cache = make_cache or (lambda request: KVCache(
            params.config, capacity=request.prompt_length + request.output_length))
        self.caches, self.outputs, self.step_seconds = {}, {}, []

    def _prompt(self, request: Request) -> list[int]:
        if request.id not in self.prompts:
            raise ValueError(f"no prompt was given for request {request.id}")
        prompt = list(self.prompts[request.id])
        if len(prompt) != request.prompt_length:
            raise ValueError(f"request {request.id} has a prompt of {request.prompt_length} "
                             f"tokens, but {len(prompt)} ids were given for it")
        needed = request.prompt_length + request.output_length - 1
        if needed > self.params.config.context_length:
            raise ValueError(f"request {request.id} needs {needed} positions; the model's "
                             f"context length is {self.params.config.context_length}")
        return prompt

    def step(self, admitted, decoded) -> None:
        """Run one step; serve() then counts it as one model step."""
        self(admitted, decoded)

    def __call__(self, admitted, decoded) -> float:
        prompts = [self._prompt(request) for request in admitted]   # checked before any work
        start = time.perf_counter()
        for request, prompt in zip(admitted, prompts):
            logits, cache = prefill(self.params, prompt, self.make_cache(request),
                                    last_only=True)
            self.caches[request.id] = cache
            self.outputs[request.id] = [int(np.argmax(logits[-1]))]
        if decoded:
            tokens = [self.outputs[r.id][-1] for r in decoded]
            logits = batched_decode_step(self.params, tokens, [self.caches[r.id] for r in
                                                               decoded], attend=self.attend)
            for request, row in zip(decoded, logits):
                self.outputs[request.id].append(int(np.argmax(row)))
        seconds = time.perf_counter() - start
        for request in list(admitted) + list(decoded):
            if len(self.outputs[request.id]) == request.output_length:
                cache = self.caches.pop(request.id)
                if hasattr(cache, "free"):          # a paged cache gives its blocks back
                    cache.free()
        self.step_seconds.append(seconds)
        return seconds
