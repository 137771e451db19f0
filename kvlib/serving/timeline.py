"""What serving a stream of requests looked like, step by step (batched_decoding): the steps a
scheduler ran (kvlib.serving.scheduler.serve) and, for every request, when it arrived, was
admitted, got its first token and finished; the numbers that compare two policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import as_real_number


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
        self.requests = {request.request_id: request for request in requests}
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
        if isinstance(request_id, bool) or not isinstance(request_id, (int, str)) or \
                request_id not in self.requests:
            raise ValueError(f"request_id must be the id of one of this timeline's requests "
                             f"{sorted(self.requests)}, got {request_id!r}")
        return request_id

    def admitted_at(self, request_id: int) -> float:
        """When the request's prefill step started."""
        return self.steps[self.admitted_step[self._request(request_id)]].start

    def time_to_first_token(self, request_id: int) -> float:
        request_id = self._request(request_id)
        return self.first_token[request_id] - self.requests[request_id].arrival

    def time_per_output_token(self, request_id: int) -> float | None:
        request_id = self._request(request_id)
        request = self.requests[request_id]
        if len(request.output_token_ids) == 1:
            return None
        return (self.finish[request_id] - self.first_token[request_id]) / \
            (len(request.output_token_ids) - 1)

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
        return sum(len(request.output_token_ids) for request in self.requests.values())

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
    return as_real_number("time_now", time_now)
