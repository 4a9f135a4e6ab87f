"""Drafts from a smaller model of the same tokenizer (`speculative_config` method `draft_model`).

The draft model is a second rank of its own: its own KV pool and runner, built by the
composition root like the target's, and driven here through the runner's contract
(`SequenceWork` in, samples out); the planner never sees it. It drafts greedily, so its
drafts are deterministic, as the acceptance rule in speculative.py requires.

For each drafting request the draft pool holds the keys and values of a prefix of the
request's tokens: what it was fed last time. A step first feeds what is new since then (the
accepted drafts, the correction, or the whole prompt the first time) and samples the first
draft; then k - 1 one-token steps each feed the draft before. They are launched back to back,
each taking its input from the step before on the device, and read once at the end. Rejected
drafts need no call back: the next step keeps the longest prefix that still matches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kestrel.core.runner import LaunchedStep, ModelRunner, SequenceWork
from kestrel.core.state import OutOfPagesError, PagedKVProvider
from kestrel.engine.speculative import DraftAsk
from kestrel.sampling_params import SamplingParams

logger = logging.getLogger("kestrel.engine")
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class FedPrefix:
    """The tokens a request's draft KV holds: the first `num_tokens` of its tokens (a request's
    tokens only grow, so these stay its own), then the drafts fed after them, which stand
    only as far as the request accepted them."""

    num_tokens: int = 0
    drafts: tuple[int, ...] = ()

    def matching(self, token_ids: Sequence[int]) -> int:
        """How many of the request's tokens the draft KV holds."""
        count = self.num_tokens
        for draft, token in zip(self.drafts, token_ids[count:]):
            if draft != token:
                break
            count += 1
        return count


@dataclass
class _Catchup:
    """One request's first draft step: the tokens it feeds and where they start."""

    ask: DraftAsk
    start: int  # tokens already in the draft pool
    num_fed: int  # of the tokens after `start`, how many this step computes
    pages: tuple[int, ...]

    @property
    def drafts(self) -> bool:
        """Whether the step reaches the request's last token, so its sample is a draft."""
        return self.start + self.num_fed == len(self.ask.token_ids)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, kv: PagedKVProvider, max_model_len: int, max_batch_tokens: int) -> None:
        self.runner, self.kv = runner, kv
        self.max_model_len, self.max_batch_tokens = max_model_len, max_batch_tokens
        self._fed: dict[str, FedPrefix] = {}  # per request, the tokens whose KV the draft pool holds

    def propose(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        catchups = self._plan_catchups(asks)
        if not catchups:
            return [() for _ in asks]
        launched = [self.runner.launch([self._catchup_work(c) for c in catchups])]
        drafting = [c for c in catchups if c.drafts]
        for index in range(1, max((c.ask.num_tokens for c in drafting), default=0)):
            work = [self._next_draft_work(c, index) for c in drafting if c.ask.num_tokens > index]
            launched.append(self.runner.launch(work))
        drafts = read_drafts(launched, [c.ask.request_id for c in drafting])
        for c in catchups:
            fed_drafts = tuple(drafts.get(c.ask.request_id, ())[: c.ask.num_tokens - 1])
            self._fed[c.ask.request_id] = FedPrefix(c.start + c.num_fed, fed_drafts)
        return [tuple(drafts.get(ask.request_id, ())) for ask in asks]

    def release(self, request_id: str) -> None:
        self._fed.pop(request_id, None)
        self.kv.release(request_id)
        self.runner.release(request_id)

    def observe(self, request_id: str, first_position: int, hidden_states: object) -> None:
        pass  # a draft model reads tokens only

    def _plan_catchups(self, asks: Sequence[DraftAsk]) -> list[_Catchup]:
        """What each request feeds first, within the step's token budget (a prompt that does
        not fit is fed in parts over several steps, drafting nothing until it is all in)."""
        catchups, budget = [], self.max_batch_tokens
        for ask in asks:
            tokens = ask.token_ids
            if budget == 0 or len(tokens) + ask.num_tokens > self.max_model_len:
                continue
            start = min(self._fed.get(ask.request_id, FedPrefix()).matching(tokens), len(tokens) - 1)
            num_fed = min(len(tokens) - start, budget)
            pages = self._reserve(ask.request_id, start, start + num_fed + ask.num_tokens - 1, asks)
            if pages is None:
                continue
            catchups.append(_Catchup(ask, start, num_fed, pages))
            budget -= num_fed
        return catchups

    def _reserve(self, request_id: str, start: int, end: int, asks: Sequence[DraftAsk]) -> tuple[int, ...] | None:
        """The request's pages for its first `end` tokens, its KV past `start` dropped; when the
        pool is full, requests that do not draft now lose their draft state first."""
        self._fed[request_id] = FedPrefix(start)
        self.kv.rollback(request_id, start)
        try:
            return tuple(self.kv.reserve(request_id, end))
        except OutOfPagesError:
            drafting = {ask.request_id for ask in asks}
            for idle in [r for r in self._fed if r not in drafting]:
                self.release(idle)
        try:
            return tuple(self.kv.reserve(request_id, end))
        except OutOfPagesError:
            logger.debug("draft pool full: request %s drafts nothing this step", request_id)
            self.release(request_id)
            return None

    def _catchup_work(self, catchup: _Catchup) -> SequenceWork:
        start, end = catchup.start, catchup.start + catchup.num_fed
        return SequenceWork(
            request_id=catchup.ask.request_id,
            token_ids=tuple(catchup.ask.token_ids[start:end]),
            num_cached_tokens=start,
            page_ids=catchup.pages,
            num_samples=int(catchup.drafts),
            params=GREEDY,
            seed=0,
        )

    def _next_draft_work(self, catchup: _Catchup, index: int) -> SequenceWork:
        """The step that feeds draft `index - 1` (still on the device) and samples draft `index`."""
        return SequenceWork(
            request_id=catchup.ask.request_id,
            token_ids=(0,),  # a placeholder: the runner takes the token from its last samples
            num_cached_tokens=len(catchup.ask.token_ids) + index - 1,
            page_ids=catchup.pages,
            num_samples=1,
            params=GREEDY,
            seed=0,
            follows_last_sample=True,
        )


def read_drafts(launched: list[LaunchedStep], request_ids: list[str]) -> dict[str, list[int]]:
    """Each drafting request's samples over the launched draft steps, in order (reading
    them waits for the last)."""
    drafts: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    for step in launched:
        for result in step.result().results:
            if result.request_id in drafts:
                drafts[result.request_id].extend(s.token_id for s in result.sampled)
    return drafts
