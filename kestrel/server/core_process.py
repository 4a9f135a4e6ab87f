"""The engine-core process: the planner + runner loop, fed and drained through one pipe.

It owns the `LLMEngine`. The front end never waits on a model step: it only sends
requests and aborts, and reads `StepResult`s as they come.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection

from kestrel.config import EngineArgs
from kestrel.core.cuda_ipc import SharedExports, is_shared_state, open_shared_state
from kestrel.core.transfer import TransferHandle, decode_handle, encode_handle
from kestrel.engine.engine import LLMEngine
from kestrel.engine.outputs import RequestOutput
from kestrel.sampling_params import RequestOutputKind
from kestrel.server.messages import (
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStats,
    ReleaseExport,
    RequestDelta,
    RequestFailed,
    Shutdown,
    StepResult,
)

IDLE_POLL_SECONDS = 0.5
logger = logging.getLogger("kestrel.core")


@dataclass
class DeltaTracker:
    """Turns the engine's DELTA outputs (what is new since the last one; text that could
    start a stop string held back by the engine) into the front end's deltas."""

    started: set[str] = field(default_factory=set)
    shared: SharedExports = field(default_factory=SharedExports)  # exported state kept on the GPU

    def track(self, request: AddRequest) -> None:
        self.started.discard(request.request_id)

    def delta(self, output: RequestOutput) -> RequestDelta:
        completion = output.outputs[0]
        first = output.request_id not in self.started
        self.started.add(output.request_id)
        if output.finished:
            self.forget(output.request_id)
        kv_state, export_id = self._handed_out(output.request_id, output.kv_state)
        return RequestDelta(
            request_id=output.request_id,
            new_token_ids=completion.token_ids,
            new_text=completion.text,
            new_logprobs=completion.logprobs,
            prompt_logprobs=output.prompt_logprobs if first else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            queue_seconds=_queue_seconds(output) if first else None,
            kv_state=kv_state,
            kv_export_id=export_id,
        )

    def _handed_out(self, request_id: str, handle: TransferHandle | None) -> tuple[bytes | None, str | None]:
        """A prefill request's exported state for the front end: bytes that hold it, or, where
        it stayed on the GPU, bytes that describe it and the id it is kept under."""
        if handle is None:
            return None, None
        if handle.location == "host":
            return encode_handle(handle), None
        return self.shared.share(request_id, handle), request_id

    def forget(self, request_id: str) -> None:
        self.started.discard(request_id)


def _queue_seconds(output: RequestOutput) -> float | None:
    metrics = output.metrics
    if metrics is None or metrics.first_scheduled_time is None:
        return None
    return metrics.first_scheduled_time - metrics.arrival_time


def _stats(engine: LLMEngine, shared: SharedExports) -> CoreStats:
    stats = engine.stats()
    own = {"kv_lent_bytes": shared.num_bytes}
    return CoreStats(**{f.name: own[f.name] if f.name in own else getattr(stats, f.name) for f in fields(CoreStats)})


def run_engine_core(args: EngineArgs, conn: Connection) -> None:
    """Entry point of the core process."""
    try:
        engine = LLMEngine(args)
    except Exception as error:  # any start-up failure goes back to the front end as text
        conn.send(CoreFailed(f"{type(error).__name__}: {error}"))
        return
    conn.send(CoreReady(engine.max_model_len, engine.parts.spec.vocab_size, engine.parts.kv.num_pages))
    try:
        _serve(engine, conn)
    finally:
        engine.shutdown()  # tensor-parallel workers go with the core


def _serve(engine: LLMEngine, conn: Connection) -> None:
    tracker = DeltaTracker()
    while True:
        failures: list[RequestFailed | RequestDelta] = []
        timeout = 0 if engine.has_unfinished_requests() else IDLE_POLL_SECONDS
        try:
            while conn.poll(timeout):
                message = conn.recv()
                timeout = 0
                if isinstance(message, Shutdown):
                    return
                failures.extend(_handle(engine, tracker, message))
        except (EOFError, OSError):
            return  # the front end is gone: nobody to serve
        deltas = failures
        if engine.has_unfinished_requests():
            deltas += [tracker.delta(output) for output in engine.step()]
        if deltas or timeout:
            conn.send(StepResult(tuple(deltas), _stats(engine, tracker.shared)))


def _imported(engine: LLMEngine, data: bytes | None) -> TransferHandle | None:
    """The state a decode request starts from: sent as bytes, or lent on the GPU."""
    if data is None:
        return None
    if is_shared_state(data):
        return open_shared_state(data, engine.parts.runtime.device)
    return decode_handle(data, location="remote prefill instance")


def _handle(engine: LLMEngine, tracker: DeltaTracker, message: object) -> list[RequestFailed | RequestDelta]:
    if isinstance(message, AddRequest):
        try:
            params = message.params.replace(output_kind=RequestOutputKind.DELTA)
            imported = _imported(engine, message.imported_state)
            engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                params,
                export_state=message.export_state,
                imported_state=imported,
            )
        except ValueError as error:
            return [RequestFailed(message.request_id, str(error))]
        tracker.track(message)
        return []
    if isinstance(message, AbortRequest):
        output = engine.abort_request(message.request_id)
        return [tracker.delta(output)] if output is not None else []
    if isinstance(message, ReleaseExport):
        tracker.shared.release(message.export_id)
        return []
    logger.error("ignoring unknown message %r", message)
    return []
