"""Turning one HTTP request into engine requests: prompts, limits, and the fan-in of choices."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kestrel.core.cuda_ipc import is_shared_state
from kestrel.engine import admission
from kestrel.engine.outputs import PositionLogprobs
from kestrel.sampling_params import SamplingParams
from kestrel.server.disaggregation import Handoff, RemoteDecode, RemotePrefill, fetch_state, release_state
from kestrel.server.engine_client import EngineClient
from kestrel.server.messages import RequestDelta
from kestrel.server.metrics import RequestTimer, ServerMetrics
from kestrel.server.protocol import bad_request

logger = logging.getLogger("kestrel.server")


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None


@dataclass
class ChoiceResult:
    """Everything one choice produced, accumulated from its deltas."""

    index: int
    prompt: PreparedPrompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_state: bytes | None = None  # a prefill instance's request: the state it hands out
    kv_export_id: str | None = None  # where that state stays on the GPU until released

    def absorb(self, delta: RequestDelta) -> None:
        self.kv_state = delta.kv_state or self.kv_state
        self.kv_export_id = delta.kv_export_id or self.kv_export_id
        self.text += delta.new_text
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.new_logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """OpenAI's rule (admission.resolve_max_tokens, strict): the prompt plus the completion
    must fit the context window. `prompt_param` names the prompt's field in errors."""
    try:
        return admission.resolve_max_tokens(
            prompt_len, requested, max_model_len, strict=True, prompt_param=prompt_param
        )
    except admission.AdmissionError as error:
        raise bad_request(str(error), error.param) from None


def validate_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    try:
        admission.check_prompt_tokens(token_ids, vocab_size, param)
    except admission.AdmissionError as error:
        raise bad_request(str(error), error.param) from None


@dataclass
class Generation:
    """The engine requests behind one HTTP request, one per choice (prompt x n)."""

    client: EngineClient
    metrics: ServerMetrics
    prompts: list[PreparedPrompt]
    params: list[SamplingParams]  # each prompt's: max_tokens resolved against its own length
    n: int
    log_requests: bool = True  # one info line per finished choice (never the prompt text)
    # Disaggregated serving: compute the prompt for a decode instance, or start from the
    # state a prefill instance computed (server/disaggregation.py).
    handoff: Handoff | None = None
    fetch_headers: dict[str, str] = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    # Choices sent to the engine so far; the rest hold seats reserved at admission.
    _num_sent: int = field(default=0, init=False)
    _releases: set[asyncio.Task] = field(default_factory=set, init=False)  # DELETEs in flight

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_params(self, index: int) -> SamplingParams:
        return admission.fan_out(self.params[index // self.n].replace(n=self.n))[index % self.n]

    async def stream(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(choice index, delta) as they arrive from every choice; leaving early aborts all."""
        merged: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(index, merged)) for index in range(self.num_choices)]
        try:
            for _ in range(self.num_choices):
                while True:
                    item = await merged.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        break  # one choice finished
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.client.release(self.num_choices - self._num_sent)

    async def _pump(self, index: int, merged: asyncio.Queue) -> None:
        prompt = self.prompts[index // self.n]
        timer = RequestTimer(self.metrics, time.monotonic(), len(prompt.token_ids))
        engine_id = f"{self.request_id}-{index}"
        num_output_tokens = 0
        finish_reason = None
        borrowed = False  # state lent by a prefill instance's GPU, until this engine has copied it
        try:
            token_ids, export, imported = await self._handoff_inputs(prompt)
            borrowed = imported is not None and is_shared_state(imported)
            # The generator takes over the request's reserved seat on its first step, which
            # runs before anything can be cancelled: counted only now, so a failed handoff
            # (no state fetched) leaves the seat for `stream` to give back.
            self._num_sent += 1
            async for delta in self.client.generate(
                engine_id,
                token_ids,
                self.choice_params(index),
                reserved=True,
                export_state=export,
                imported_state=imported,
            ):
                if borrowed:  # any answer from the core comes after its copy
                    borrowed = self._give_back_borrowed()
                now = time.monotonic()
                timer.tokens(now, len(delta.new_token_ids), delta.queue_seconds)
                num_output_tokens += len(delta.new_token_ids)
                if delta.finish_reason is not None:
                    finish_reason = delta.finish_reason
                    timer.finished(now, delta.finish_reason)
                    if self.log_requests:
                        logger.info(
                            "request %s finished: %d prompt tokens, %d output tokens, finish_reason %s, %.2f s",
                            engine_id,
                            len(prompt.token_ids),
                            num_output_tokens,
                            delta.finish_reason,
                            now - timer.start,
                        )
                merged.put_nowait((index, delta))
            merged.put_nowait(None)
        except asyncio.CancelledError:
            if finish_reason is None:  # the client left: the engine request is aborted
                timer.finished(time.monotonic(), "abort")
            raise
        except Exception as error:  # handed to the consumer, which decides the HTTP answer
            merged.put_nowait(error)
        finally:
            if borrowed:
                self._give_back_borrowed()

    def _give_back_borrowed(self) -> bool:
        """Tell the prefill instance its lent state may go, without waiting for its answer."""
        if not isinstance(self.handoff, RemotePrefill):
            return False
        task = asyncio.ensure_future(release_state(self.handoff, self.fetch_headers))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return False

    async def _handoff_inputs(self, prompt: PreparedPrompt) -> tuple[list[int], bool, bytes | None]:
        """The engine request's tokens, whether it exports its state, and the state it imports.
        A prefill instance computes all but the last token: the decode instance computes that
        one, so its own sampler draws the first output token."""
        handoff = self.handoff
        if isinstance(handoff, RemoteDecode):
            return prompt.token_ids[:-1], True, None
        if isinstance(handoff, RemotePrefill) and handoff.transfer_id is not None:
            return prompt.token_ids, False, await fetch_state(handoff, self.fetch_headers, self.metrics)
        return prompt.token_ids, False, None

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult(i, self.prompts[i // self.n]) for i in range(self.num_choices)]
        async for index, delta in self.stream():
            results[index].absorb(delta)
        return results


async def run_until_disconnect(work: Any, is_disconnected: Any, poll_seconds: float = 0.2) -> Any:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_seconds)
        if done:
            return task.result()
        if await is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
