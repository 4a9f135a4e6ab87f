"""The engine-core process: the planner + runner loop, fed and drained through one pipe.

It owns the `LLMEngine`. The front end never waits on a model step: it only sends
requests and aborts, and reads `StepResult`s as they come.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection

from kestrel.config import EngineArgs
from kestrel.core.transfer import decode_handle, encode_handle
from kestrel.engine.engine import LLMEngine
from kestrel.engine.outputs import RequestOutput
from kestrel.sampling_params import RequestOutputKind
from kestrel.server.messages import (
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStats,
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

    def track(self, request: AddRequest) -> None:
        self.started.discard(request.request_id)

    def delta(self, output: RequestOutput) -> RequestDelta:
        completion = output.outputs[0]
        first = output.request_id not in self.started
        self.started.add(output.request_id)
        if output.finished:
            self.forget(output.request_id)
        return RequestDelta(
            request_id=output.request_id,
            new_token_ids=completion.token_ids,
            new_text=completion.text,
            new_logprobs=completion.logprobs,
            prompt_logprobs=output.prompt_logprobs if first else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            queue_seconds=_queue_seconds(output) if first else None,
            kv_state=encode_handle(output.kv_state) if output.kv_state is not None else None,
        )

    def forget(self, request_id: str) -> None:
        self.started.discard(request_id)


def _queue_seconds(output: RequestOutput) -> float | None:
    metrics = output.metrics
    if metrics is None or metrics.first_scheduled_time is None:
        return None
    return metrics.first_scheduled_time - metrics.arrival_time


def _stats(engine: LLMEngine) -> CoreStats:
    stats = engine.stats()
    return CoreStats(**{stat.name: getattr(stats, stat.name) for stat in fields(CoreStats)})


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
            conn.send(StepResult(tuple(deltas), _stats(engine)))


def _handle(engine: LLMEngine, tracker: DeltaTracker, message: object) -> list[RequestFailed | RequestDelta]:
    if isinstance(message, AddRequest):
        try:
            params = message.params.replace(output_kind=RequestOutputKind.DELTA)
            imported = None
            if message.imported_state is not None:
                imported = decode_handle(message.imported_state, location="remote prefill instance")
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
    logger.error("ignoring unknown message %r", message)
    return []
