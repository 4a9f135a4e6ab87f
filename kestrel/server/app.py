"""The OpenAI-compatible HTTP front end: routes, auth, errors. The model runs in the core process."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import kestrel
from kestrel.server.disaggregation import RemoteDecode
from kestrel.server.engine_client import EngineDeadError, RequestRejected
from kestrel.server.errors import BodySizeLimit, StrictJsonRoute, install_error_handlers
from kestrel.server.formatting import (
    chat_logprobs,
    legacy_logprobs,
    prompt_logprobs_entries,
    text_offsets,
    token_id_piece,
    usage,
)
from kestrel.server.generation import (
    ChoiceResult,
    Generation,
    PreparedPrompt,
    validate_token_ids,
)
from kestrel.server.messages_api import CountTokensRequest, MessagesRequest, count_tokens, create_message
from kestrel.server.preparation import (
    chat_prompt,
    collect_results,
    encode_text,
    generation_for,
    prepare_chat,
    sampling_for,
    truncated_prompts,
)
from kestrel.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    bad_request,
)
from kestrel.server.responses_api import ResponsesRequest, create_response
from kestrel.server.state import ServerState
from kestrel.server.structured import checked_constraint
from kestrel.server.tools import ChatDeltas, ChatFormat


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Kestrel", version=kestrel.__version__)
    app.router.route_class = StrictJsonRoute  # before the routes: each is built with it
    app.state.kestrel = state
    install_error_handlers(app)

    app.add_middleware(BodySizeLimit, limit=state.settings.max_request_body_bytes)

    async def require_key(request: Request) -> None:
        key = state.settings.api_key
        given = request.headers.get("authorization", "")
        if key is not None and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "invalid or missing API key", "AuthenticationError")

    @app.get("/health")
    async def health() -> Response:
        if not state.client.alive:
            return JSONResponse({"status": "unhealthy", "reason": state.client.dead_reason}, status_code=503)
        if state.draining:  # a load balancer stops routing here while in-flight requests finish
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kestrel.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(state.client.stats), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {
            "id": state.settings.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kestrel",
            "root": state.settings.model_path,
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_key)])
    async def model(model_id: str) -> dict:
        state.check_model(model_id)
        return model_card()

    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        if body.messages is not None:
            tokens = (await chat_prompt(state, body.messages, True)).token_ids
        elif body.prompt is not None:
            tokens = await encode_text(state, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        else:
            raise bad_request("give either prompt or messages", "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        validate_token_ids(body.tokens or [0], state.client.info.vocab_size, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(state, body, request)

    @app.get("/v1/kv_transfer/{transfer_id}", dependencies=[Depends(require_key)])
    async def kv_transfer(transfer_id: str) -> Response:
        """A prefilled state, once, for the decode instance (server/disaggregation.py)."""
        return Response(state.transfers.take(transfer_id), media_type="application/octet-stream")

    @app.delete("/v1/kv_transfer/{transfer_id}", dependencies=[Depends(require_key)])
    async def kv_transfer_release(transfer_id: str) -> dict:
        """The decode instance has copied a state lent on this GPU (or no longer wants it)."""
        state.transfers.release(transfer_id)
        return {"id": transfer_id, "released": True}

    @app.post("/v1/messages", dependencies=[Depends(require_key)])
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(state, body, request)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(require_key)])
    async def messages_count_tokens(body: CountTokensRequest) -> dict:
        return await count_tokens(state, body)

    @app.post("/v1/responses", dependencies=[Depends(require_key)])
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(state, body, request)

    return app


def _piece(state: ServerState, body: SamplingFields) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:N" where the request asks for ids."""
    return token_id_piece if body.return_tokens_as_token_ids else state.piece


# ---- completions ----------------------------------------------------------------------------


async def _completion_prompts(state: ServerState, prompt: Any) -> list[PreparedPrompt]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    prepared = []
    for item in prompts:
        if isinstance(item, str):
            prepared.append(PreparedPrompt(await encode_text(state, item, "prompt"), item))
        else:
            prepared.append(PreparedPrompt(list(item), None))
        validate_token_ids(prepared[-1].token_ids, state.client.info.vocab_size)
    return prepared


async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    state.check_model(body.model)
    prompts = truncated_prompts(body, await _completion_prompts(state, body.prompt), state.max_model_len)
    prompt_logprobs = _prompt_logprobs_count(state, body)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 unless echo is set", "max_tokens")
    constraint = await checked_constraint(body)
    params_for = sampling_for(
        body, body.max_tokens, state, "prompt", constraint, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
    )
    generation = generation_for(state, body, prompts, params_for)
    if isinstance(generation.handoff, RemoteDecode):
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        return await _prefill_for_decode(state, generation, request, "text_completion", choice)
    if body.stream:
        return _sse(_completion_chunks(state, body, generation))
    results = await collect_results(generation, request)
    if results is None:
        return Response(status_code=499)
    choices = [_completion_choice(state, body, r) for r in results]
    return JSONResponse(
        {
            "id": f"cmpl-{generation.request_id}",
            "object": "text_completion",
            "created": generation.created,
            "model": state.settings.served_model_name,
            "choices": choices,
            "usage": usage(sum(len(p.token_ids) for p in prompts), sum(len(r.token_ids) for r in results)),
        }
    )


def _prompt_logprobs_count(state: ServerState, body: CompletionRequest) -> int | None:
    """How many alternatives the engine scores at each prompt position: for `echo` with
    `logprobs`, and for vLLM's `prompt_logprobs` (whole responses only), the larger."""
    echoed = body.logprobs if body.echo and body.logprobs is not None else None
    asked = body.prompt_logprobs
    if asked is None:
        return echoed
    if body.stream:
        raise bad_request("prompt_logprobs is not supported with stream: true", "prompt_logprobs")
    limit = state.settings.max_logprobs
    if not 0 <= asked <= limit:
        raise bad_request(f"prompt_logprobs must be in [0, {limit}] (--max-logprobs), got {asked}", "prompt_logprobs")
    return max(asked, echoed or 0)


def _completion_choice(state: ServerState, body: CompletionRequest, result: ChoiceResult) -> dict:
    prompt = result.prompt
    prompt_text = prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.token_ids)
    text = (prompt_text + result.text) if body.echo else result.text
    logprobs = None
    if body.logprobs is not None:
        token_ids, entries = result.token_ids, list(result.logprobs)
        offsets = text_offsets(state.tokenizer, prompt.token_ids, token_ids, len(prompt_text) if body.echo else 0)
        if body.echo:
            token_ids = prompt.token_ids + token_ids
            entries = list(result.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
            offsets = text_offsets(state.tokenizer, [], prompt.token_ids, 0) + offsets
        logprobs = legacy_logprobs(token_ids, entries, body.logprobs, _piece(state, body), offsets)
    choice = {
        "index": result.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
    if body.prompt_logprobs is not None:
        entries = result.prompt_logprobs or [None] * len(prompt.token_ids)
        choice["prompt_logprobs"] = prompt_logprobs_entries(
            prompt.token_ids, entries, body.prompt_logprobs, _piece(state, body)
        )
    return choice


async def _completion_chunks(
    state: ServerState, body: CompletionRequest, generation: Generation
) -> AsyncIterator[dict]:
    completion_tokens = 0
    offsets = [0] * generation.num_choices
    echoed = [not body.echo] * generation.num_choices
    async for index, delta in generation.stream():
        completion_tokens += len(delta.new_token_ids)
        prompt = generation.prompts[index // generation.n]
        text = delta.new_text
        if not echoed[index]:
            echo = prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.token_ids)
            text, offsets[index], echoed[index] = echo + text, len(echo), True
        logprobs = None
        if body.logprobs is not None:
            # One token per delta but for the last steps' catch-up: later tokens of a delta start
            # where the one before them ends, by its own text.
            starts = [offsets[index]]
            for token_id in delta.new_token_ids[:-1]:
                starts.append(starts[-1] + len(state.piece(token_id)))
            piece = _piece(state, body)
            logprobs = legacy_logprobs(delta.new_token_ids, delta.new_logprobs or [], body.logprobs, piece, starts)
            offsets[index] += len(delta.new_text)
        yield _chunk(
            state,
            generation,
            "text_completion",
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            },
        )
    if body.stream_options and body.stream_options.include_usage:
        prompt_tokens = sum(len(p.token_ids) for p in generation.prompts)
        yield _chunk(state, generation, "text_completion", None, usage(prompt_tokens, completion_tokens))


async def _prefill_for_decode(
    state: ServerState, generation: Generation, request: Request, object_name: str, choice: dict
) -> Response:
    """A prefill instance's answer: every prompt token but the last computed, their state held
    for the decode instance that `kv_transfer_params` name, and nothing generated."""
    (prompt,) = generation.prompts
    num_tokens = len(prompt.token_ids) - 1
    transfer_id = None
    if num_tokens == 0:  # a one-token prompt: the decode instance computes it all
        state.client.release(generation.num_choices)
    else:
        results = await collect_results(generation, request)
        if results is None:
            return Response(status_code=499)
        (result,) = results
        if result.kv_state is None:
            raise ApiError(
                503, f"the prefill ended before its state was handed out ({result.finish_reason})", "Aborted"
            )
        transfer_id = state.transfers.put(result.kv_state, result.kv_export_id)
    return JSONResponse(
        {
            "id": f"prefill-{generation.request_id}",
            "object": object_name,
            "created": generation.created,
            "model": state.settings.served_model_name,
            "choices": [choice],
            "usage": usage(len(prompt.token_ids), 0),
            "kv_transfer_params": {"transfer_id": transfer_id, "num_tokens": num_tokens},
        }
    )


# ---- chat -----------------------------------------------------------------------------------


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    prepared = await prepare_chat(state, body)
    prompt, generation, chat, logprobs = prepared.prompt, prepared.generation, prepared.chat, prepared.logprobs
    if isinstance(generation.handoff, RemoteDecode):
        message = {"role": "assistant", "content": ""}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        return await _prefill_for_decode(state, generation, request, "chat.completion", choice)
    if body.stream:
        return _sse(_chat_chunks(state, body, generation, chat))
    results = await collect_results(generation, request)
    if results is None:
        return Response(status_code=499)
    choices = []
    for r in results:
        message = chat.message(r.text)
        choices.append(
            {
                "index": r.index,
                "message": message,
                "logprobs": chat_logprobs(r.token_ids, r.logprobs, logprobs, _piece(state, body), state.tokenizer)
                if body.logprobs
                else None,
                "finish_reason": _chat_finish_reason(r.finish_reason, bool(message.get("tool_calls"))),
                "stop_reason": r.stop_reason,
            }
        )
    return JSONResponse(
        {
            "id": f"chatcmpl-{generation.request_id}",
            "object": "chat.completion",
            "created": generation.created,
            "model": state.settings.served_model_name,
            "choices": choices,
            "usage": usage(len(prompt.token_ids), sum(len(r.token_ids) for r in results)),
        }
    )


def _chat_finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" where the model stopped after calling tools."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


async def _chat_chunks(
    state: ServerState, body: ChatCompletionRequest, generation: Generation, chat: ChatFormat
) -> AsyncIterator[dict]:
    for index in range(generation.num_choices):
        yield _chunk(
            state,
            generation,
            "chat.completion.chunk",
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            },
        )
    completion_tokens = 0
    count = body.top_logprobs or 0
    streams = [ChatDeltas(chat) for _ in range(generation.num_choices)]
    async for index, delta in generation.stream():
        completion_tokens += len(delta.new_token_ids)
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(
                delta.new_token_ids, delta.new_logprobs or [], count, _piece(state, body), state.tokenizer
            )
        finished = delta.finish_reason is not None
        content = streams[index].push(delta.new_text, final=finished)
        if not content and not finished:
            content = {"content": ""}  # text held back (a marker may be starting): one chunk per step still
        yield _chunk(
            state,
            generation,
            "chat.completion.chunk",
            {
                "index": index,
                "delta": content,
                "logprobs": logprobs,
                "finish_reason": _chat_finish_reason(delta.finish_reason, streams[index].num_calls > 0),
                "stop_reason": delta.stop_reason,
            },
        )
    if body.stream_options and body.stream_options.include_usage:
        prompt_tokens = len(generation.prompts[0].token_ids)
        yield _chunk(state, generation, "chat.completion.chunk", None, usage(prompt_tokens, completion_tokens))


# ---- shared ---------------------------------------------------------------------------------


def _chunk(
    state: ServerState, generation: Generation, kind: str, choice: dict | None, usage_: dict | None = None
) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    body = {
        "id": f"{prefix}-{generation.request_id}",
        "object": kind,
        "created": generation.created,
        "model": state.settings.served_model_name,
        "choices": [] if choice is None else [choice],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestRejected as error:
            yield f"data: {json.dumps(bad_request(str(error)).body())}\n\n"
        except EngineDeadError as error:
            yield f"data: {json.dumps(ApiError(503, str(error), 'ServiceUnavailableError').body())}\n\n"
        except ApiError as error:  # e.g. the prefilled state could not be fetched
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
