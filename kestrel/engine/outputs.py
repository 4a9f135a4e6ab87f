"""What generation returns, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kestrel.core.transfer import TransferHandle


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One position's logprobs: the chosen token plus the top-N alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() clock of the engine's process
    first_scheduled_time: float | None
    # Speculative decoding: draft tokens checked for this request, and how many of them stood.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # A finished request added with `export_state`: its computed state, for a decode instance.
    kv_state: TransferHandle | None = None
