"""The OpenAI-compatible HTTP front end: routes, auth, errors. The model runs in the core process."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import kestrel
from kestrel.engine.reasoning import reasoning_format
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.server.engine_client import EngineClient, EngineDeadError, RequestRejected
from kestrel.server.errors import BodySizeLimit, install_error_handlers
from kestrel.server.formatting import chat_logprobs, legacy_logprobs, text_offsets, token_id_piece, usage
from kestrel.server.generation import (
    ChoiceResult,
    Generation,
    PreparedPrompt,
    resolve_max_tokens,
    run_until_disconnect,
    validate_token_ids,
)
from kestrel.server.metrics import ServerMetrics
from kestrel.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    bad_request,
)
from kestrel.server.structured import checked_constraint
from kestrel.server.tool_parsers import TOOL_CALL_PARSERS
from kestrel.server.tools import ChatDeltas, ChatFormat, resolve_tool_choice, tool_constraint

RETRY_AFTER_SECONDS = 1  # what a refused request's Retry-After says: the queue moves every step


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_path: str
    api_key: str | None
    max_queue_len: int
    max_num_seqs: int
    log_requests: bool = True
    max_request_body_bytes: int = 32 << 20
    model_aliases: tuple[str, ...] = ()  # further names requests may use (--served-model-name a b)
    max_logprobs: int = 20
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" works
    reasoning_parser: str | None = None


class ServerState:
    """What the routes share: the engine client, tokenizer, metrics and drain flag."""

    def __init__(self, settings: ServerSettings, client: EngineClient, tokenizer: Any) -> None:
        self.settings = settings
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics(settings.served_model_name)
        self.draining = False
        parser = settings.tool_call_parser
        self.tool_parser = TOOL_CALL_PARSERS[parser]() if parser is not None else None
        self.reasoning = reasoning_format(settings.reasoning_parser) if settings.reasoning_parser else None

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def check_model(self, model: str | None) -> None:
        names = (self.settings.served_model_name, *self.settings.model_aliases)
        if model is not None and model not in names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def check_capacity(self, new_requests: int) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", "ServiceUnavailableError")
        if not self.client.alive:
            raise ApiError(503, f"the engine is not running: {self.client.dead_reason}", "ServiceUnavailableError")
        limit = self.settings.max_num_seqs + self.settings.max_queue_len
        if new_requests > limit:  # could never be admitted: retrying cannot help
            raise bad_request(
                f"the request asks for {new_requests} sequences (prompts x n); this server holds at most {limit}",
                "n",
            )
        if self.client.num_in_flight + new_requests > limit:
            raise ApiError(
                429,
                f"the server is overloaded: more than {limit} requests in flight; retry later",
                "RateLimitError",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.client.reserve(new_requests)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Kestrel", version=kestrel.__version__)
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
            tokens = (await _chat_prompt(state, body.messages, True)).token_ids
        elif body.prompt is not None:
            tokens = await _encode(state, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        else:
            raise bad_request("give either prompt or messages", "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        validate_token_ids(body.tokens or [0], state.client.info.vocab_size)
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(state, body, request)

    return app


def _piece(state: ServerState, body: SamplingFields) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:N" where the request asks for ids."""
    return token_id_piece if body.return_tokens_as_token_ids else state.piece


def _check_named_token_ids(params: SamplingParams, vocab_size: int) -> None:
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise bad_request(f"{name} holds token ids out of range [0, {vocab_size}): {outside[:5]}", name)


def _named_field(message: str, body: SamplingFields) -> str | None:
    """The request field a sampling error names first ("temperature must be ..."), if any."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in type(body).model_fields else None


# ---- completions ----------------------------------------------------------------------------


async def _encode(state: ServerState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, tokenized off the event loop (a megabyte-long prompt takes seconds,
    and streams and health checks must not wait for it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(
            f"{param} is not valid Unicode text: {error.reason} at position {error.start}", param
        ) from None
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens=add_special_tokens)


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
            prepared.append(PreparedPrompt(await _encode(state, item, "prompt"), item))
        else:
            prepared.append(PreparedPrompt(list(item), None))
        validate_token_ids(prepared[-1].token_ids, state.client.info.vocab_size)
    return prepared


def _generation(state: ServerState, body: SamplingFields, prompts: list[PreparedPrompt], params_for: Any) -> Generation:
    params = None
    for prompt in prompts:
        params = params_for(len(prompt.token_ids))  # validates each prompt against the context window
    state.check_capacity(len(prompts) * body.n)
    return Generation(state.client, state.metrics, prompts, params, body.n, state.settings.log_requests)


def _sampling(
    body: SamplingFields,
    requested_max: int | None,
    state: ServerState,
    prompt_param: str,
    constraint: StructuredOutputsParams | None = None,
    keep_special_tokens: bool = False,
    **logprob_args: Any,
) -> Any:
    def params_for(prompt_len: int):
        max_tokens = resolve_max_tokens(requested_max, prompt_len, state.max_model_len, prompt_param)
        limit = state.settings.max_logprobs
        for count in logprob_args.values():
            if count is not None and count > limit:
                field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
                raise bad_request(f"{field} {count} is above this server's limit of {limit} (--max-logprobs)", field)
        try:
            params = body.sampling_params(max_tokens, **logprob_args)
        except ValueError as error:
            raise bad_request(str(error), _named_field(str(error), body)) from None
        _check_named_token_ids(params, state.client.info.vocab_size)
        if keep_special_tokens:  # tool-call markers that are special tokens must stay in the text
            params = params.replace(skip_special_tokens=False)
        return params.replace(structured_outputs=constraint)

    return params_for


async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    state.check_model(body.model)
    if body.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    prompts = await _completion_prompts(state, body.prompt)
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 unless echo is set", "max_tokens")
    constraint = await checked_constraint(body)
    params_for = _sampling(
        body, body.max_tokens, state, "prompt", constraint, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
    )
    generation = _generation(state, body, prompts, params_for)
    if body.stream:
        return _sse(_completion_chunks(state, body, generation))
    results = await _collect(generation, request)
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
    return {
        "index": result.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }


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


# ---- chat -----------------------------------------------------------------------------------


async def _chat_prompt(
    state: ServerState,
    messages: list,
    add_generation_prompt: bool,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> PreparedPrompt:
    if state.tokenizer.chat_template is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    conversation = [m.template_dict() for m in messages]
    try:
        text = await asyncio.to_thread(
            state.tokenizer.apply_chat_template,
            conversation,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as error:  # template errors are the request's fault (e.g. roles out of order)
        raise bad_request(f"cannot apply the chat template: {error}", "messages") from None
    token_ids = await _encode(state, text, "messages", add_special_tokens=False)
    validate_token_ids(token_ids, state.client.info.vocab_size)
    return PreparedPrompt(token_ids, text)


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(body.model)
    choice = resolve_tool_choice(body, state.tool_parser)
    chat = ChatFormat(choice, state.tool_parser, state.reasoning)
    constraint = await checked_constraint(body, tool_constraint(choice, body.tools or [], body.parallel_tool_calls))
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    prompt = await _chat_prompt(state, body.messages, body.add_generation_prompt, body.chat_template_kwargs, tools)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested == 0:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    keep_special = choice.mode == "auto" and state.tool_parser.keeps_special_tokens
    params_for = _sampling(
        body, requested, state, "messages", constraint, keep_special, logprobs=logprobs, prompt_logprobs=None
    )
    generation = _generation(state, body, [prompt], params_for)
    if body.stream:
        return _sse(_chat_chunks(state, body, generation, chat))
    results = await _collect(generation, request)
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


async def _collect(generation: Generation, request: Request) -> list[ChoiceResult] | None:
    try:
        return await run_until_disconnect(generation.collect(), request.is_disconnected)
    except RequestRejected as error:
        raise bad_request(str(error)) from None
    except EngineDeadError as error:
        raise ApiError(503, str(error), "ServiceUnavailableError") from None


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestRejected as error:
            yield f"data: {json.dumps(bad_request(str(error)).body())}\n\n"
        except EngineDeadError as error:
            yield f"data: {json.dumps(ApiError(503, str(error), 'ServiceUnavailableError').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
