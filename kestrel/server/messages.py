"""The small typed messages between the HTTP front end and the engine-core process."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.engine.outputs import PositionLogprobs
from kestrel.sampling_params import SamplingParams

# ---- front end -> core --------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    export_state: bool = False  # a prefill instance's request: hand its state out when it finishes
    imported_state: bytes | None = None  # a decode instance's: start from this prefilled state


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class ReleaseExport:
    """The state lent under `export_id` (`RequestDelta.kv_export_id`) is no longer needed."""

    export_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- core -> front end --------------------------------------------------------------------


@dataclass(frozen=True)
class CoreReady:
    max_model_len: int
    vocab_size: int
    num_total_pages: int


@dataclass(frozen=True)
class CoreFailed:
    message: str


@dataclass(frozen=True)
class RequestDelta:
    """What one request gained in one step; text is held back while it could still turn out
    to be the start of a stop string."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[PositionLogprobs] | None
    prompt_logprobs: list[PositionLogprobs | None] | None  # sent once, with the first delta
    finish_reason: str | None
    stop_reason: int | str | None
    queue_seconds: float | None  # arrival to first scheduling, sent once
    kv_state: bytes | None = None  # with the last delta of an `export_state` request
    # Set where `kv_state` only describes state the core keeps on its GPU (CUDA IPC) until a
    # `ReleaseExport` with this id.
    kv_export_id: str | None = None


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    message: str


@dataclass(frozen=True)
class CoreStats:
    num_running: int
    num_waiting: int
    num_used_pages: int
    num_total_pages: int
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens reused
    num_preemptions: int = 0  # cumulative requests preempted for pages
    kv_offload_hit_tokens: int = 0  # cumulative: of those, tokens copied back from the host tier
    kv_offload_stored_bytes: int = 0  # cumulative bytes copied to the host tier, and back
    kv_offload_loaded_bytes: int = 0
    structured_requests: int = 0  # cumulative requests with a structured-output constraint
    kv_lent_bytes: int = 0  # prefilled state kept on the GPU for decode instances (CUDA IPC)
    grammars_compiled: int = 0  # cumulative, and the seconds they took on the compile threads
    grammar_compile_seconds: float = 0.0
    grammar_mask_seconds: float = 0.0  # cumulative host time filling token masks
    spec_decode_num_drafts: int = 0  # cumulative verify chunks, draft tokens, accepted drafts
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_pages / self.num_total_pages if self.num_total_pages else 0.0


@dataclass(frozen=True)
class StepResult:
    deltas: tuple[RequestDelta | RequestFailed, ...]
    stats: CoreStats
