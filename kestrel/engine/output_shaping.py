"""Shaping what the engine reports about a request: vLLM's `RequestOutput`, whole or as the
delta since the last report, with each logprob's decoded token."""

from __future__ import annotations

from typing import Any

from kestrel.core.sampling import TokenLogprobs
from kestrel.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kestrel.engine.request import Request, RequestStatus
from kestrel.sampling_params import RequestOutputKind


class OutputShaper:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def position_logprobs(self, logprobs: TokenLogprobs) -> PositionLogprobs:
        entries = {logprobs.token_id: Logprob(logprobs.logprob, logprobs.rank, self._piece(logprobs.token_id))}
        for rank, (token_id, value) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1):
            if token_id not in entries:
                entries[token_id] = Logprob(value, rank, self._piece(token_id))
        return entries

    def _piece(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def output(self, request: Request) -> RequestOutput:
        if request.params.output_kind is RequestOutputKind.DELTA:
            return self._delta_output(request)
        return self._request_output(
            request, request.text, list(request.output_token_ids), request.logprobs, request.prompt_logprobs
        )

    @staticmethod
    def _request_output(
        request: Request,
        text: str,
        token_ids: list[int],
        logprobs: list[PositionLogprobs] | None,
        prompt_logprobs: list[PositionLogprobs | None] | None,
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=request.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_list,
            prompt_logprobs=prompt_logprobs,
            outputs=[completion],
            finished=request.status is RequestStatus.FINISHED,
            metrics=RequestMetrics(
                request.arrival_time,
                request.first_scheduled_time,
                request.num_draft_tokens,
                request.num_accepted_tokens,
            ),
        )

    def _delta_output(self, request: Request) -> RequestOutput:
        """What is new since the request's last output. Until it finishes, text that could
        be the start of a stop string stays back: a stop string can cut the text there, and
        text already reported cannot be taken back."""
        finished = request.status is RequestStatus.FINISHED
        text_end = len(request.text)
        if not finished and request.params.stop:
            held = max(len(stop) for stop in request.params.stop) - 1
            text_end = max(request.num_sent_chars, text_end - held)
        first_token = request.num_prompt_tokens + request.num_sent_tokens
        logprobs = None
        if request.logprobs is not None:
            logprobs = request.logprobs[request.num_sent_logprobs :]
        first = request.num_sent_tokens == 0
        output = self._request_output(
            request,
            request.text[request.num_sent_chars : text_end],
            request.token_ids[first_token:],
            logprobs,
            request.prompt_logprobs if first else None,
        )
        request.num_sent_tokens = request.num_output_tokens
        request.num_sent_chars = text_end
        request.num_sent_logprobs += len(logprobs or ())
        return output
