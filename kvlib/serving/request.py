"""One request, as every serving lesson tracks it (vLLM's Request, nano-vllm's Sequence), and
how it is decoded (SamplingParams).

A request arrives with its prompt's token ids and its SamplingParams. From then on it holds
its tokens (prompt, then output), how many of them have K and V in the cache
(num_computed_tokens), its block table in the pool, and its status: waiting, running or
finished. The engine (the_engine) and the scheduler of batched_decoding move it through those
states; the pool timeline (paged_cache) and the prefix server (prefix_caching) serve it from
their pools. requests_of_lengths makes the lessons' seeded workloads, where only the lengths
matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..checks import as_count, as_real_number, as_whole_number, as_whole_numbers
from ..config import ModelConfig

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
"""A request's status (vLLM's RequestStatus, without its finer states)."""

STOP, LENGTH, ABORT = "stop", "length", "abort"
"""Why a request finished (vLLM's finish_reason): a stop token came out, max_tokens were
reached, or the caller aborted it."""


@dataclass(frozen=True)
class SamplingParams:
    """How a request is decoded (vLLM's SamplingParams, the fields kvlib needs): max_tokens
    new tokens at most; temperature 0 for greedy, otherwise sampled with a generator seeded
    by seed; generation also stops after any of stop_token_ids; n independent completions of
    the prompt (the engine serves them as n requests sharing the prompt's blocks, vLLM V1's
    ParentRequest).

    The values are copied in: stop_token_ids becomes a tuple of ints, so that changing the
    caller's list later changes no request. A child of a request with n > 1 and a seed
    samples with seed + its index (vLLM's children each get their own generator too).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1

    def __post_init__(self):
        as_whole_number("max_tokens", self.max_tokens, 1)
        object.__setattr__(self, "temperature",
                           as_real_number("temperature", self.temperature, minimum=0))
        if self.seed is not None:
            as_whole_number("seed", self.seed, 0)
        object.__setattr__(self, "stop_token_ids", tuple(
            as_whole_numbers("stop_token_ids", self.stop_token_ids).tolist()))
        as_count("n", self.n, 1)

    def child(self, index: int) -> SamplingParams:
        """The SamplingParams of completion `index` of n: n = 1, its own seed (seed + index)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


@dataclass(eq=False)            # two requests are the same only if they are the same object
class Request:
    """One request (vLLM's Request): its id, prompt, SamplingParams and arrival (an engine step,
    or seconds), then what serving it changes: the output so far, how many of its tokens have
    K and V in the cache, its block table (or, in an engine with several KV cache groups,
    block_tables: one table a group, kvlib.serving.kv_cache_manager), how many of its full
    blocks entered the prefix cache, its status, why it finished (finish_reason: "stop",
    "length" or "abort"), the steps at which it was first scheduled, got its first token
    and finished, and its own random generator (seeded by sampling_params.seed). A
    completion of a request with n > 1 names its parent (parent_id) and its index among
    the n.

    all_token_ids is prompt_token_ids + output_token_ids, kept as one list (as vLLM does) so
    that a step reads any slice of it without joining the two.
    """

    request_id: int | str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False, repr=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    num_cached_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    status: str = WAITING
    finish_reason: str | None = None
    parent_id: int | str | None = None
    index: int = 0
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)
        self.rng = np.random.default_rng(self.sampling_params.seed)

    def __repr__(self) -> str:
        """The request as a scheduler sees it: its id, arrival, and lengths (the output's
        length is max_tokens, the most it will produce)."""
        return (f"Request(id={self.request_id}, arrival={self.arrival}, "
                f"prompt_length={self.num_prompt_tokens}, output_length={self.max_tokens})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def tokens(self) -> list[int]:
        """all_token_ids, by the name engine.forward_step reads."""
        return self.all_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def max_num_tokens(self) -> int:
        """Positions its cache holds at the most: prompt + max_tokens (the last token chosen is
        never fed back, but a server does not know which one is last: paged_cache counts
        them all)."""
        return self.num_prompt_tokens + self.max_tokens

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def fresh(self, arrival: float | None = None) -> Request:
        """The same request not yet served (at another arrival, if given): serving it changes
        the copy, never this one."""
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                       self.arrival if arrival is None else arrival, parent_id=self.parent_id,
                       index=self.index)

    def snapshot(self) -> dict:
        """Everything serving may change, copied: restore(snapshot) puts it back (the
        engine's all-or-nothing step). Field by field from the request itself, so a new field
        is saved without a word here."""
        state = {name: _copied(value) for name, value in vars(self).items()}
        state["rng"] = self.rng.bit_generator.state
        return state

    def restore(self, state: dict) -> None:
        rng_state = state["rng"]
        vars(self).update({name: value for name, value in state.items() if name != "rng"})
        self.rng.bit_generator.state = rng_state


def _copied(value):
    """A list copied (a list of lists, such as block_tables, to the bottom); anything else
    as it is."""
    return [_copied(item) for item in value] if isinstance(value, list) else value


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one step: its new tokens (none while its prompt is still
    being prefilled in chunks), whether it finished, and why (finish_reason: "stop",
    "length", "abort"; None while it runs)."""

    request_id: int | str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


def requests_of_lengths(prompt_lengths, output_lengths, arrivals=None, seed: int = 0,
                        vocab_size: int = ModelConfig.vocab_size) -> list[Request]:
    """Requests 0, 1, ... of the given prompt and output lengths (max_tokens), arriving at
    arrivals (all at 0 by default), each prompt seeded random ids below vocab_size (the toy's
    vocabulary by default): the workloads of paged_cache and batched_decoding, where only the
    lengths matter."""
    prompt_lengths = as_whole_numbers("prompt_lengths", prompt_lengths, 1)
    rng = np.random.default_rng([as_whole_number("seed", seed, 0), 1])
    vocab_size = as_count("vocab_size", vocab_size, 1)
    arrivals = [0] * len(prompt_lengths) if arrivals is None else list(arrivals)
    return [Request(i, rng.integers(0, vocab_size, int(p)).tolist(),
                    SamplingParams(max_tokens=int(o)), a)
            for i, (p, o, a) in enumerate(zip(prompt_lengths, output_lengths, arrivals))]
