"""Turning a request's fields into engine work, shared by every generating route: text to
token ids, chat templates, sampling params with their constraint, the fan-out into a
`Generation`, and waiting for it while the client stays."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from kestrel.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.server.disaggregation import parse_handoff
from kestrel.server.engine_client import EngineDeadError, RequestRejected
from kestrel.server.generation import (
    ChoiceResult,
    Generation,
    PreparedPrompt,
    resolve_max_tokens,
    run_until_disconnect,
    validate_token_ids,
)
from kestrel.server.protocol import (
    CHAT_NOT_YET_SUPPORTED,
    NOT_YET_SUPPORTED,
    ApiError,
    ChatCompletionRequest,
    SamplingFields,
    bad_request,
    validation_problems,
)
from kestrel.server.state import ServerState
from kestrel.server.structured import checked_constraint
from kestrel.server.tools import ChatFormat, resolve_tool_choice, tool_constraint


def check_named_token_ids(params: SamplingParams, vocab_size: int) -> None:
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise bad_request(f"{name} holds token ids out of range [0, {vocab_size}): {outside[:5]}", name)


def named_field(message: str, body: SamplingFields) -> str | None:
    """The request field a sampling error names first ("temperature must be ..."), if any."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in type(body).model_fields else None


async def encode_text(state: ServerState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, tokenized off the event loop (a megabyte-long prompt takes seconds,
    and streams and health checks must not wait for it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(
            f"{param} is not valid Unicode text: {error.reason} at position {error.start}", param
        ) from None
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens=add_special_tokens)


def truncated_prompts(body: SamplingFields, prompts: list[PreparedPrompt], max_model_len: int) -> list[PreparedPrompt]:
    """vLLM's `truncate_prompt_tokens`: each prompt's last N tokens (-1: the context window's
    worth); a truncated prompt's text is decoded from what is kept, where it is needed."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompts
    if keep == -1:
        keep = max_model_len
    if keep == 0 or keep > max_model_len:
        message = f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the context window), got {keep}"
        raise bad_request(message, "truncate_prompt_tokens")
    return [p if len(p.token_ids) <= keep else PreparedPrompt(p.token_ids[-keep:], None) for p in prompts]


def generation_for(
    state: ServerState, body: SamplingFields, prompts: list[PreparedPrompt], params_for: Any
) -> Generation:
    params = [params_for(len(prompt.token_ids)) for prompt in prompts]  # each against the context window
    handoff = parse_handoff(body.kv_transfer_params, state.settings.kv_role, body.n, bool(body.stream))
    if handoff is not None and len(prompts) != 1:
        raise bad_request("kv_transfer_params hand over one prompt; send one", "kv_transfer_params")
    state.check_capacity(len(prompts) * body.n)
    api_key = state.settings.api_key  # the instances of one deployment share it
    return Generation(
        state.client,
        state.metrics,
        prompts,
        params,
        body.n,
        state.settings.log_requests,
        handoff=handoff,
        fetch_headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
    )


def sampling_for(
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
            raise bad_request(str(error), named_field(str(error), body)) from None
        check_named_token_ids(params, state.client.info.vocab_size)
        if keep_special_tokens:  # tool-call markers that are special tokens must stay in the text
            params = params.replace(skip_special_tokens=False)
        return params.replace(structured_outputs=constraint)

    return params_for


async def chat_prompt(
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
    token_ids = await encode_text(state, text, "messages", add_special_tokens=False)
    validate_token_ids(token_ids, state.client.info.vocab_size)
    return PreparedPrompt(token_ids, text)


async def collect_results(generation: Generation, request: Request) -> list[ChoiceResult] | None:
    try:
        return await run_until_disconnect(generation.collect(), request.is_disconnected)
    except RequestRejected as error:
        raise bad_request(str(error)) from None
    except EngineDeadError as error:
        raise ApiError(503, str(error), "ServiceUnavailableError") from None


def with_extra_fields(fields: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """A translated request's chat fields plus the chat fields its sender added beside the
    API's own (vLLM's `top_k`, `guided_regex`, ... in `extra_body`), so none is dropped."""
    if (extra or {}).get("kv_transfer_params") is not None:
        raise bad_request(
            "kv_transfer_params are served on /v1/completions and /v1/chat/completions", "kv_transfer_params"
        )
    known = set(ChatCompletionRequest.model_fields) | set(NOT_YET_SUPPORTED) | set(CHAT_NOT_YET_SUPPORTED)
    return {**{key: value for key, value in (extra or {}).items() if key in known}, **fields}


def translated_chat_request(fields: dict[str, Any], extra: dict[str, Any] | None, param: str) -> ChatCompletionRequest:
    """The chat request another API's request stands for (`with_extra_fields`); what it gets
    wrong is a 400 naming `param`, the field the sender wrote, not the translation's."""
    try:
        return ChatCompletionRequest(**with_extra_fields(fields, extra))
    except ValidationError as error:
        raise bad_request(validation_problems(error.errors()).replace("messages", param), param) from None
    except ValueError as error:
        raise bad_request(f"{param}: {error}", param) from None


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready to run: its prompt, its generation, and how its text becomes a message."""

    prompt: PreparedPrompt
    generation: Generation
    chat: ChatFormat
    logprobs: int | None


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> PreparedChat:
    """Validate a chat request (tools, constraint, template, limits) and build its generation;
    every chat-shaped API (chat completions, responses, messages) comes through here."""
    state.check_model(body.model)
    choice = resolve_tool_choice(body, state.tool_parser)
    chat = ChatFormat(choice, state.tool_parser, state.reasoning, body.parallel_tool_calls)
    constraint = await checked_constraint(body, tool_constraint(choice, body.tools or [], body.parallel_tool_calls))
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    prompt = await chat_prompt(state, body.messages, body.add_generation_prompt, template_kwargs, tools)
    (prompt,) = truncated_prompts(body, [prompt], state.max_model_len)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested == 0:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    keep_special = choice.mode == "auto" and state.tool_parser.keeps_special_tokens
    params_for = sampling_for(
        body, requested, state, "messages", constraint, keep_special, logprobs=logprobs, prompt_logprobs=None
    )
    return PreparedChat(prompt, generation_for(state, body, [prompt], params_for), chat, logprobs)
