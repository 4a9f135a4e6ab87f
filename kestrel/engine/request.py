"""A request's lifecycle state, owned by the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kestrel.core.transfer import TransferHandle
from kestrel.engine.detokenizer import IncrementalDetokenizer
from kestrel.engine.outputs import PositionLogprobs
from kestrel.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    max_tokens: int  # resolved: never beyond max_model_len
    detokenizer: IncrementalDetokenizer | None
    prompt: str | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt then generated tokens
    num_computed_tokens: int = 0  # tokens whose KV is written, or queued to be by a launched step
    num_pending_tokens: int = 0  # sampled by a launched step whose results are not read yet
    # Speculative decoding: tokens guessed to follow `token_ids`, checked by the next step.
    draft_token_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0  # drafts checked so far, and how many of them stood
    num_accepted_tokens: int = 0
    # Its state in host memory: while preempted by swap, or as a prefill instance handed it over.
    swapped: TransferHandle | None = None
    # A prefill instance's request: its computed state is exported when it finishes (`exported`).
    export_state: bool = False
    exported: TransferHandle | None = None
    status: RequestStatus = RequestStatus.WAITING
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    arrival_time: float = 0.0  # time.monotonic() at add_request
    first_scheduled_time: float | None = None
    # The prompt as the list every output of this request shares: a streamed request with a
    # long prompt would otherwise copy it on every step.
    prompt_token_list: list[int] = field(default_factory=list)
    # DELTA outputs: how much of the output has been reported already.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.prompt_token_list = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no context

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens the planner counts: known ones plus those still being sampled."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
