"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: input items and
instructions become chat messages, `text.format` a structured-output constraint, function
tools chat tools; the answer comes back as output items (reasoning, message, function calls),
whole or as Responses streaming events. Responses are not stored: `store: true` and
`previous_response_id` are refused by name."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kestrel.server.engine_client import EngineDeadError, RequestRejected
from kestrel.server.formatting import usage
from kestrel.server.preparation import collect_results, prepare_chat, translated_chat_request
from kestrel.server.protocol import (
    RESPONSES_NOT_YET_SUPPORTED,
    ApiError,
    ChatCompletionRequest,
    bad_request,
    refuse_what_asks,
)
from kestrel.server.state import ServerState
from kestrel.server.tools import ChatDeltas


class InputPart(BaseModel):
    """One part of an input item's content; only text parts are served (`_text`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str = ""


Content = str | list[InputPart] | None


class InputItem(BaseModel):
    """An input item: a message, an earlier function call, its output, or earlier reasoning.
    Typed, so that a malformed one is a 400 that names where it is."""

    model_config = ConfigDict(extra="allow")
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] = "user"
    content: Content = None
    call_id: str | None = None
    name: str | None = None
    arguments: str = "{}"
    output: Content = None


class ResponsesRequest(BaseModel):
    # vLLM's sampling and guided_* fields ride along (extra_body) into the chat request.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses request stands for (a 400 naming what cannot be)."""
    if body.store:
        raise bad_request("store is not supported: this server keeps no responses (send store: false)", "store")
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: send the whole input", "previous_response_id")
    refuse_what_asks(body.model_extra or {}, RESPONSES_NOT_YET_SUPPORTED)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += [{"role": "user", "content": body.input}] if isinstance(body.input, str) else _messages(body.input)
    fields: dict[str, Any] = dict(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        reasoning_effort=(body.reasoning or {}).get("effort"),
    )
    if body.tools:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    return translated_chat_request(fields, body.model_extra, "input")


def _messages(items: list[InputItem]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        if item.type == "message":
            messages.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif item.type != "reasoning":  # earlier reasoning is not sent back to the model
            raise bad_request(f"input item type {item.type!r} is not supported", "input")
    return messages


def _text(content: Content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in ("input_text", "output_text", "text"):
            raise bad_request(f"content part type {part.type!r} is not supported (text only)", "input")
    return "".join(part.text for part in content)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object, e.g. {type: json_schema, name, schema}", "text")
    if not fmt or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(f"tool type {tool.get('type')!r} is not supported (function tools only)", "tools")
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {key: tool[key] for key in fields if tool.get(key) is not None}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not choice.get("name"):
        raise bad_request("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


# Chat fields an error may name, as the Responses API calls them.
RESPONSES_FIELDS = {"response_format": "text", "max_tokens": "max_output_tokens", "messages": "input"}


async def create_response(state: ServerState, body: ResponsesRequest, request: Request) -> Response:
    try:
        prepared = await prepare_chat(state, chat_request(body))
    except ApiError as error:
        error.param = RESPONSES_FIELDS.get(error.param, error.param)
        raise
    shape = _ResponseShape(state, body, prepared.prompt.token_ids)
    if body.stream:
        events = _events(shape, prepared)
        return StreamingResponse(_sse(events), media_type="text/event-stream")
    results = await collect_results(prepared.generation, request)
    if results is None:
        return Response(status_code=499)
    (result,) = results
    message = prepared.chat.message(result.text)
    return JSONResponse(shape.response(message, result.finish_reason, len(result.token_ids)))


class _ResponseShape:
    """The response object and its output items, in OpenAI's shape."""

    def __init__(self, state: ServerState, body: ResponsesRequest, prompt_ids: list[int]) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.settings.served_model_name
        self.body, self.num_prompt_tokens = body, len(prompt_ids)
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"

    def response(
        self, message: dict[str, Any] | None, finish_reason: str | None, num_output_tokens: int
    ) -> dict[str, Any]:
        done = message is not None
        incomplete = finish_reason == "length"
        counts = usage(self.num_prompt_tokens, num_output_tokens)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "instructions": self.body.instructions,
            "output": self.items(message) if done else [],
            "tools": self.body.tools or [],
            "tool_choice": self.body.tool_choice or "auto",
            "parallel_tool_calls": self.body.parallel_tool_calls,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "max_output_tokens": self.body.max_output_tokens,
            "text": self.body.text or {"format": {"type": "text"}},
            "metadata": self.body.metadata or {},
            "store": False,
            "usage": {
                "input_tokens": counts["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": counts["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": counts["total_tokens"],
            }
            if done
            else None,
        }

    def items(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        items = []
        if message.get("reasoning_content"):
            items.append(self.reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            items.append(self.message_item(message["content"]))
        items += [self.call_item(call) for call in message.get("tool_calls", [])]
        return items

    def reasoning_item(self, text: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
        }

    @staticmethod
    def call_item(call: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call['id'].removeprefix('call_')}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }


async def _events(shape: _ResponseShape, prepared: Any) -> AsyncIterator[dict[str, Any]]:
    """Responses streaming events: created, then each item as it comes (text and reasoning
    deltas, function calls once complete), then completed with the whole response."""
    yield {"type": "response.created", "response": shape.response(None, None, 0)}
    yield {"type": "response.in_progress", "response": shape.response(None, None, 0)}
    deltas = ChatDeltas(prepared.chat)
    stream = _ItemStream(shape)
    text, num_tokens, finish_reason = "", 0, None
    async for _, delta in prepared.generation.stream():
        text += delta.new_text
        num_tokens += len(delta.new_token_ids)
        finish_reason = delta.finish_reason
        for event in stream.events(deltas.push(delta.new_text, final=finish_reason is not None)):
            yield event
    for event in stream.close():
        yield event
    yield {
        "type": "response.completed",
        "response": shape.response(prepared.chat.message(text), finish_reason, num_tokens),
    }


class _ItemStream:
    """Chat deltas as Responses events, opening and closing output items in order."""

    def __init__(self, shape: _ResponseShape) -> None:
        self.shape = shape
        self.open: str | None = None  # "reasoning" or "message": the item now streaming
        self.texts = {"reasoning": "", "message": ""}
        self.index = -1

    def events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._close()
            item = self.shape.call_item(call)
            self.index += 1
            events += [
                {"type": "response.output_item.added", "output_index": self.index, "item": {**item, "arguments": ""}},
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": self.index,
                    "delta": item["arguments"],
                },
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": self.index,
                    "arguments": item["arguments"],
                },
                {"type": "response.output_item.done", "output_index": self.index, "item": item},
            ]
        return events

    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events += self._close()
            self.open, self.index = kind, self.index + 1
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": self.index,
                    "item": self._item(kind, "in_progress"),
                }
            )
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                events.append({"type": "response.content_part.added", **self._where(kind), "part": part})
        self.texts[kind] += piece
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append({"type": name, **self._where(kind), "delta": piece})
        return events

    def _where(self, kind: str) -> dict[str, Any]:
        item_id = self.shape.message_id if kind == "message" else self.shape.reasoning_id
        return {"item_id": item_id, "output_index": self.index, "content_index": 0}

    def _item(self, kind: str, status: str) -> dict[str, Any]:
        if kind == "reasoning":
            return self.shape.reasoning_item(self.texts[kind] if status == "completed" else "")
        return self.shape.message_item(self.texts[kind], status)

    def _close(self) -> list[dict[str, Any]]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        text = self.texts[kind]
        events = []
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            events += [
                {"type": "response.output_text.done", **self._where(kind), "text": text},
                {"type": "response.content_part.done", **self._where(kind), "part": part},
            ]
        else:
            events.append({"type": "response.reasoning_text.done", **self._where(kind), "text": text})
        events.append(
            {"type": "response.output_item.done", "output_index": self.index, "item": self._item(kind, "completed")}
        )
        return events

    def close(self) -> list[dict[str, Any]]:
        return self._close()


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    number = 0
    try:
        async for event in events:
            yield _event(event, number)
            number += 1
    except (RequestRejected, EngineDeadError) as error:  # the stream has begun: an error event ends it
        yield _event({"type": "error", "code": type(error).__name__, "message": str(error), "param": None}, number)


def _event(event: dict[str, Any], number: int) -> str:
    return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number})}\n\n"
