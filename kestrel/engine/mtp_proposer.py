"""Drafts from a checkpoint's multi-token-prediction head (`speculative_config` method `mtp`).

The head (models/mtp.py) runs as a draft rank of its own, as a draft model does, but row i
of it reads the target's final hidden state at position i beside the token at i + 1, and
predicts the token at i + 2. So the target's runner keeps its hidden states, the engine hands
each request's standing ones to `observe`, and this proposer feeds the head the rows it lacks:
positions up to the one before the request's last token, whose hidden state predicted that
token. Their last row samples the first draft; each further draft is one more row that takes
the draft before it and the head's own output hidden state (`hidden_output`) for it, on the
device, launched back to back. Those chained rows are the head's guesses, never confirmed:
the next step writes over them with rows built from the target's hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kestrel.core.runner import ModelRunner, SequenceWork
from kestrel.core.state import PagedKVProvider
from kestrel.engine.draft_model import GREEDY, DraftModelProposer, FedPrefix, read_drafts
from kestrel.engine.speculative import DraftAsk

if TYPE_CHECKING:  # the model modules import Triton kernels: not on the server's request path
    from kestrel.models.mtp import MtpDraft


@dataclass(frozen=True)
class _Pending:
    """The target's hidden states of positions [first, first + len(states)) the head has not
    been fed yet."""

    first: int
    states: torch.Tensor

    @property
    def end(self) -> int:
        return self.first + self.states.shape[0]


@dataclass(frozen=True)
class _Rows:
    """One request's catch-up: head rows [start, start + count), sampling where it ends the
    rows the request has (`drafts`)."""

    ask: DraftAsk
    start: int
    count: int
    pages: tuple[int, ...]

    @property
    def drafts(self) -> bool:
        return self.start + self.count == len(self.ask.token_ids) - 1


class MtpProposer(DraftModelProposer):
    def __init__(
        self,
        runner: ModelRunner,
        kv: PagedKVProvider,
        max_model_len: int,
        max_batch_tokens: int,
        head: MtpDraft,
    ) -> None:
        super().__init__(runner, kv, max_model_len, max_batch_tokens)
        self.head = head
        self._pending: dict[str, _Pending] = {}

    def observe(self, request_id: str, first_position: int, hidden_states: torch.Tensor) -> None:
        fed = self._fed.get(request_id, FedPrefix()).num_tokens
        old = self._pending.get(request_id)
        if old is not None and old.first <= first_position <= old.end:
            merged = _Pending(old.first, torch.cat([old.states[: first_position - old.first], hidden_states]))
        else:
            merged = _Pending(first_position, hidden_states)
        if merged.first > fed:  # rows the head needs were never seen: it cannot catch up
            self.release(request_id)
            return
        self._pending[request_id] = _Pending(fed, merged.states[fed - merged.first :])

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._pending.pop(request_id, None)

    def propose(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        catchups = sorted(self._plan_rows(asks), key=lambda r: r.count != 1)  # the runner's order
        if not catchups:
            return [() for _ in asks]
        self._fill_hidden_input([self._pending[r.ask.request_id].states[: r.count] for r in catchups])
        launched = [self.runner.launch([self._rows_work(r) for r in catchups])]
        drafting = [r for r in catchups if r.drafts]
        # Each drafting request's sample row of the step just launched, in the head's outputs.
        ends = torch.tensor([r.count for r in catchups]).cumsum(0) - 1
        sample_rows = ends[[i for i, r in enumerate(catchups) if r.drafts]]
        for index in range(1, max((r.ask.num_tokens for r in drafting), default=0)):
            chained = [i for i, r in enumerate(drafting) if r.ask.num_tokens > index]
            rows = sample_rows[chained].to(self.head.hidden_output.device)
            self.head.hidden_input[: len(chained)].copy_(self.head.hidden_output[rows])
            launched.append(self.runner.launch([self._chained_work(drafting[i], index) for i in chained]))
            drafting, sample_rows = [drafting[i] for i in chained], torch.arange(len(chained))
        drafts = read_drafts(launched, [r.ask.request_id for r in catchups if r.drafts])
        for r in catchups:
            self._fed[r.ask.request_id] = FedPrefix(r.start + r.count)
            pending = self._pending[r.ask.request_id]
            self._pending[r.ask.request_id] = _Pending(r.start + r.count, pending.states[r.count :])
        return [tuple(drafts.get(ask.request_id, ())) for ask in asks]

    def _plan_rows(self, asks: Sequence[DraftAsk]) -> list[_Rows]:
        """The rows each request feeds, within the step's token budget: those its pending
        hidden states allow, up to the one before its last token."""
        plans, budget = [], self.max_batch_tokens
        for ask in asks:
            pending = self._pending.get(ask.request_id)
            wanted = len(ask.token_ids) - 1  # rows the request has: a hidden state and the token after it
            if pending is None or pending.end < wanted or budget == 0 or wanted + ask.num_tokens > self.max_model_len:
                continue
            count = min(wanted - pending.first, budget)
            if count <= 0:
                continue
            pages = self._reserve(ask.request_id, pending.first, pending.first + count + ask.num_tokens - 1, asks)
            if pages is None:
                continue
            plans.append(_Rows(ask, pending.first, count, pages))
            budget -= count
        return plans

    def _fill_hidden_input(self, parts: list[torch.Tensor]) -> None:
        rows = torch.cat(parts)
        self.head.hidden_input[: rows.shape[0]].copy_(rows)

    def _rows_work(self, rows: _Rows) -> SequenceWork:
        tokens = rows.ask.token_ids
        return SequenceWork(
            request_id=rows.ask.request_id,
            token_ids=tuple(tokens[rows.start + 1 : rows.start + 1 + rows.count]),
            num_cached_tokens=rows.start,
            page_ids=rows.pages,
            num_samples=int(rows.drafts),
            params=GREEDY,
            seed=0,
        )

    def _chained_work(self, rows: _Rows, index: int) -> SequenceWork:
        """Row `index` past the request's rows: draft `index - 1` (still on the device) in,
        draft `index` out."""
        return SequenceWork(
            request_id=rows.ask.request_id,
            token_ids=(0,),  # a placeholder: the runner takes the token from its last samples
            num_cached_tokens=len(rows.ask.token_ids) - 2 + index,
            page_ids=rows.pages,
            num_samples=1,
            params=GREEDY,
            seed=0,
            follows_last_sample=True,
        )
