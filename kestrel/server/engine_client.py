"""The front end's handle on the engine-core process: start it, stream deltas, abort, watch it."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kestrel.config import EngineArgs
from kestrel.sampling_params import SamplingParams
from kestrel.server.core_process import run_engine_core
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

STARTUP_TIMEOUT_SECONDS = 600
MAX_MESSAGES_PER_READ = 16


class EngineDeadError(RuntimeError):
    pass


class RequestRejected(ValueError):
    """The core refused the request (the message says why)."""


@dataclass
class _Pending:
    queue: asyncio.Queue
    finished: bool = False


class EngineClient:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.info: CoreReady | None = None
        self.stats = CoreStats(0, 0, 0, 0)
        self.dead_reason: str | None = None
        self._pending: dict[str, _Pending] = {}
        self._reserved = 0
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(args, child_conn), name="kestrel-core")
        self._child_conn = child_conn

    def launch(self) -> None:
        """Start the core process; it imports and loads the model while the caller goes on."""
        self._process.start()
        self._child_conn.close()

    def kill(self) -> None:
        """Stop a core that was launched but is no longer wanted (the server failed to start)."""
        self._process.kill()
        self._process.join()

    async def wait_ready(self) -> CoreReady:
        """Wait for the launched core's model to be loaded, then start reading its replies."""
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, self._wait_ready)
        loop.add_reader(self._conn.fileno(), self._on_readable)
        loop.add_reader(self._process.sentinel, self._on_core_exit)
        self.info = ready
        self.stats = CoreStats(0, 0, 0, ready.num_total_pages)
        return ready

    def _wait_ready(self) -> CoreReady:
        if not self._conn.poll(STARTUP_TIMEOUT_SECONDS):
            raise EngineDeadError("the engine core did not start in time")
        try:
            message = self._conn.recv()
        except EOFError:
            raise EngineDeadError(f"the engine core exited during start-up (code {self._process.exitcode})") from None
        if isinstance(message, CoreFailed):
            raise EngineDeadError(f"the engine core failed to start: {message.message}")
        return message

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        """Requests registered, plus seats reserved for requests admitted but not yet sent."""
        return len(self._pending) + self._reserved

    def reserve(self, count: int) -> None:
        """Hold `count` seats for admitted requests: admission and registration are apart by
        awaits (tokenization, the response's start), and a burst must not pass the limit between."""
        self._reserved += count

    def release(self, count: int) -> None:
        """Give back seats reserved for requests that will never be sent."""
        self._reserved = max(self._reserved - count, 0)

    # ---- reading ----------------------------------------------------------------------------

    def _on_readable(self) -> None:
        # A bounded batch per callback: a fast core keeps the pipe non-empty, and draining
        # it to the end would starve every other task on the event loop.
        try:
            for _ in range(MAX_MESSAGES_PER_READ):
                self._dispatch(self._conn.recv())
                if not self._conn.poll():
                    break
        except (EOFError, OSError):
            self._on_core_exit()

    def _dispatch(self, message: object) -> None:
        if not isinstance(message, StepResult):
            return
        self.stats = message.stats
        for item in message.deltas:
            pending = self._pending.get(item.request_id)
            if pending is not None:
                pending.queue.put_nowait(item)
            elif isinstance(item, RequestDelta) and item.kv_export_id is not None:
                self.release_export(item.kv_export_id)  # its requester has left: nobody will fetch it

    def _on_core_exit(self) -> None:
        if self.dead_reason is not None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        loop.remove_reader(self._conn.fileno())
        self._process.join(timeout=1)
        self.dead_reason = f"the engine core process exited unexpectedly (exit code {self._process.exitcode})"
        for pending in self._pending.values():
            pending.queue.put_nowait(EngineDeadError(self.dead_reason))

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        reserved: bool = False,
        export_state: bool = False,
        imported_state: bytes | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Deltas for one request until it finishes; leaving early aborts it in the core.
        `reserved`: the request takes over a seat that `reserve` held for it. `export_state` and
        `imported_state`: disaggregated serving's handoff (`LLMEngine.add_request`)."""
        if reserved:
            self.release(1)
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        pending = _Pending(asyncio.Queue())
        self._pending[request_id] = pending
        try:
            self._conn.send(AddRequest(request_id, prompt_token_ids, params, export_state, imported_state))
            while True:
                item = await pending.queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                if isinstance(item, RequestFailed):
                    pending.finished = True
                    raise RequestRejected(item.message)
                yield item
                if item.finish_reason is not None:
                    pending.finished = True
                    return
        finally:
            del self._pending[request_id]
            if not pending.finished:
                self.abort(request_id)
            self._release_unread_exports(pending.queue)

    def abort(self, request_id: str) -> None:
        if self.dead_reason is None:
            with contextlib.suppress(OSError):  # the core died meanwhile; the sentinel reports it
                self._conn.send(AbortRequest(request_id))

    def release_export(self, export_id: str) -> None:
        """Let the core free state it lent on its GPU (`RequestDelta.kv_export_id`)."""
        if self.dead_reason is None:
            with contextlib.suppress(OSError):
                self._conn.send(ReleaseExport(export_id))

    def _release_unread_exports(self, queue: asyncio.Queue) -> None:
        while not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, RequestDelta) and item.kv_export_id is not None:
                self.release_export(item.kv_export_id)

    def abort_all(self) -> None:
        for request_id in list(self._pending):
            self.abort(request_id)

    async def shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        if self.dead_reason is None:
            loop.remove_reader(self._conn.fileno())
            loop.remove_reader(self._process.sentinel)
            self.dead_reason = "the server is shutting down"
            with contextlib.suppress(OSError):  # already gone: nothing to stop
                self._conn.send(Shutdown())
        await loop.run_in_executor(None, self._process.join, 30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
