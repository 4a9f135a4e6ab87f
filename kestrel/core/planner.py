"""The planner: scheduling policy as pure logic over plain data; no tensors, no model.

Continuous batching with a per-step token budget, chunked prefill, a cap on running
sequences, FCFS admission, and preemption by recompute (newest first) when pages run out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RequestView:
    """What the planner sees of one request."""

    request_id: str
    num_tokens: int  # prompt plus generated tokens
    num_computed_tokens: int  # tokens whose KV is already in the cache
    num_pages: int  # KV pages the request holds now


@dataclass(frozen=True)
class QueueState:
    waiting: tuple[RequestView, ...]  # in admission order: preempted first, then FCFS
    running: tuple[RequestView, ...]  # in admission order, oldest first


@dataclass(frozen=True)
class Capacity:
    free_pages: int
    page_size: int


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    num_new_tokens: int
    num_computed_tokens: int
    num_new_pages: int = 0  # pages the chunk takes from the pool, its lookahead included


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[ScheduledChunk, ...]  # running requests first, then newly admitted ones
    preempted: tuple[str, ...]  # lose their KV pages and go back to the front of the queue
    admitted: tuple[str, ...]  # waiting requests that start running this step

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.scheduled)


@dataclass(frozen=True)
class PlannerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    # Pages reserved past each scheduled chunk, for tokens a step may add beyond the ones it
    # computes (a verify row's draft tokens, written in the next step).
    num_lookahead_tokens: int = 0
    # Chunks never cross a multiple of this many tokens (0: no such stops): a hybrid model's
    # prefix cache keeps the recurrent state at each, and only a chunk's end leaves it there.
    snapshot_interval: int = 0


class Planner(Protocol):
    def plan(self, queue: QueueState, capacity: Capacity) -> StepPlan: ...


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class FcfsPlanner:
    def __init__(self, config: PlannerConfig) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        self.config = config

    def plan(self, queue: QueueState, capacity: Capacity) -> StepPlan:
        config = self.config
        step = _StepBuilder(
            config.max_num_batched_tokens, capacity, config.num_lookahead_tokens, config.snapshot_interval
        )
        step.schedule_running(list(queue.running))
        if not step.preempted:
            # After a preemption the pool is tight; admitting more would only thrash.
            step.admit_waiting(queue.waiting, self.config.max_num_seqs)
        return StepPlan(
            scheduled=tuple(step.scheduled),
            preempted=tuple(step.preempted),
            admitted=tuple(step.admitted),
        )


class _StepBuilder:
    """Mutable bookkeeping while one plan is built; never escapes `plan`."""

    def __init__(self, token_budget: int, capacity: Capacity, lookahead: int = 0, stop_every: int = 0) -> None:
        self.token_budget = token_budget
        self.lookahead = lookahead
        self.stop_every = stop_every
        self.free_pages = capacity.free_pages
        self.page_size = capacity.page_size
        self.scheduled: list[ScheduledChunk] = []
        self.preempted: list[str] = []
        self.admitted: list[str] = []
        self.num_running = 0

    def _chunk_size(self, request: RequestView) -> int:
        """Its remaining tokens, within the step's budget and up to the next stop."""
        size = min(request.num_tokens - request.num_computed_tokens, self.token_budget)
        if self.stop_every:
            size = min(size, self.stop_every - request.num_computed_tokens % self.stop_every)
        return size

    def _new_pages(self, request: RequestView, num_new_tokens: int) -> int:
        total = pages_for(request.num_computed_tokens + num_new_tokens + self.lookahead, self.page_size)
        return max(total - request.num_pages, 0)

    def _take(self, request: RequestView, num_new_tokens: int, new_pages: int) -> None:
        self.free_pages -= new_pages
        self.token_budget -= num_new_tokens
        chunk = ScheduledChunk(request.request_id, num_new_tokens, request.num_computed_tokens, new_pages)
        self.scheduled.append(chunk)

    def schedule_running(self, running: list[RequestView]) -> None:
        index = 0
        while index < len(running) and self.token_budget > 0:
            request = running[index]
            num_new = self._chunk_size(request)
            if num_new <= 0:  # all computed, nothing to sample (a prompt-only request): it finishes as read
                index += 1
                continue
            new_pages = self._new_pages(request, num_new)
            while new_pages > self.free_pages:
                victim = running.pop()  # the newest running request gives way
                self.preempted.append(victim.request_id)
                if victim is request:
                    break
                self.free_pages += victim.num_pages
            else:
                self._take(request, num_new, new_pages)
                index += 1
        self.num_running = len(running)

    def admit_waiting(self, waiting: tuple[RequestView, ...], max_num_seqs: int) -> None:
        for request in waiting:
            if self.num_running >= max_num_seqs or self.token_budget <= 0:
                return
            num_new = self._chunk_size(request)
            new_pages = self._new_pages(request, num_new)
            # Leave a page of headroom per running request: without it a request preempted
            # for room is readmitted into the pages it just gave back, and preempted again as
            # soon as the others grow, recomputing its prompt each time.
            if new_pages + self.num_running > self.free_pages:
                return  # strict FCFS: nobody overtakes the head of the queue
            self._take(request, num_new, new_pages)
            self.admitted.append(request.request_id)
            self.num_running += 1
