"""The engine-core process: the planner + runner loop, fed and drained through one pipe.

It owns the `LLMEngine`. The front end never waits on a model step: it only sends
requests and aborts, and reads `StepResult`s as they come.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from kestrel.config import EngineArgs
from kestrel.engine.engine import LLMEngine
from kestrel.engine.outputs import RequestOutput
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
class _Sent:
    """How much of a request's output the front end already has."""

    num_tokens: int = 0
    num_chars: int = 0
    num_logprobs: int = 0
    started: bool = False


@dataclass
class DeltaTracker:
    """Turns the engine's cumulative outputs into deltas."""

    stops: dict[str, int] = field(default_factory=dict)  # request id -> longest stop string
    sent: dict[str, _Sent] = field(default_factory=dict)

    def track(self, request: AddRequest) -> None:
        self.stops[request.request_id] = max((len(s) for s in request.params.stop), default=0)
        self.sent[request.request_id] = _Sent()

    def delta(self, output: RequestOutput) -> RequestDelta:
        completion = output.outputs[0]
        sent = self.sent[output.request_id]
        text = completion.text
        if not output.finished:
            # Hold back what could be the start of a stop string split across tokens.
            text = text[: max(sent.num_chars, len(text) - max(self.stops[output.request_id] - 1, 0))]
        logprobs = completion.logprobs[sent.num_logprobs :] if completion.logprobs is not None else None
        first = not sent.started
        delta = RequestDelta(
            request_id=output.request_id,
            new_token_ids=completion.token_ids[sent.num_tokens :],
            new_text=text[sent.num_chars :],
            new_logprobs=logprobs,
            prompt_logprobs=output.prompt_logprobs if first else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            queue_seconds=_queue_seconds(output) if first else None,
        )
        sent.num_tokens, sent.num_chars, sent.started = len(completion.token_ids), len(text), True
        sent.num_logprobs += len(logprobs or ())
        if output.finished:
            self.forget(output.request_id)
        return delta

    def forget(self, request_id: str) -> None:
        self.stops.pop(request_id, None)
        self.sent.pop(request_id, None)


def _queue_seconds(output: RequestOutput) -> float | None:
    metrics = output.metrics
    if metrics is None or metrics.first_scheduled_time is None:
        return None
    return metrics.first_scheduled_time - metrics.arrival_time


def _stats(engine: LLMEngine) -> CoreStats:
    stats = engine.stats()
    return CoreStats(
        stats.num_running,
        stats.num_waiting,
        stats.num_used_pages,
        stats.num_total_pages,
        stats.prefix_cache_queries,
        stats.prefix_cache_hits,
    )


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
            engine.add_request(message.request_id, message.prompt_token_ids, message.params)
        except ValueError as error:
            return [RequestFailed(message.request_id, str(error))]
        tracker.track(message)
        return []
    if isinstance(message, AbortRequest):
        output = engine.abort_request(message.request_id)
        return [tracker.delta(output)] if output is not None else []
    logger.error("ignoring unknown message %r", message)
    return []
