"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
chat path: content blocks (text, tool_use, tool_result) become chat messages, `tools` with
`input_schema` chat tools, `tool_choice` (auto, any, tool, none) the chat tool choice; the
answer comes back as content blocks (thinking, text, tool_use), whole or as Anthropic's
streaming events. Errors take Anthropic's shape on these routes (server/errors.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kestrel.server.engine_client import EngineDeadError, RequestRejected
from kestrel.server.preparation import chat_prompt, collect_results, prepare_chat, translated_chat_request
from kestrel.server.protocol import (
    MESSAGES_NOT_YET_SUPPORTED,
    ChatCompletionRequest,
    ChatMessage,
    bad_request,
    refuse_what_asks,
)
from kestrel.server.state import ServerState
from kestrel.server.tools import ChatDeltas

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


class TextBlock(BaseModel):
    """A block of a system prompt or a tool result; only text blocks are read (`_text`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str = ""


class ContentBlock(TextBlock):
    """A block of a message's content: text, tool_use, tool_result, or earlier thinking.
    Typed, so that a malformed one is a 400 that names where it is."""

    id: str | None = None
    name: str | None = None
    input: dict[str, Any] = Field(default_factory=dict)
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str | None = None
    content: str | list[ContentBlock]


class MessagesRequest(BaseModel):
    # vLLM's sampling and guided_* fields ride along (extra_body) into the chat request.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None


def chat_messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict[str, Any]]:
    chat = [{"role": "system", "content": _text(system)}] if system else []
    for message in messages:
        role, content = message.role, message.content
        if role not in ("user", "assistant"):
            raise bad_request(f"message role must be user or assistant, got {role!r}", "messages")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        chat += _blocks(role, content)
    return chat


def _blocks(role: str, blocks: list[ContentBlock]) -> list[dict[str, Any]]:
    """One turn's content blocks: its text, its tool calls, and tool results as tool messages."""
    texts, calls, results = [], [], []
    for block in blocks:
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        elif block.type not in ("thinking", "redacted_thinking"):  # earlier thinking is not sent back
            raise bad_request(f"content block type {block.type!r} is not supported", "messages")
    turn = [{"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})}]
    return results + (turn if texts or calls else [])


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.text for block in content if block.type == "text")


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    refuse_what_asks(body.model_extra or {}, MESSAGES_NOT_YET_SUPPORTED)
    fields: dict[str, Any] = dict(
        model=body.model,
        messages=chat_messages(body.system, body.messages),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
    )
    if body.thinking is not None and body.thinking.get("type") == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if body.tools:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    choice = body.tool_choice or {}
    if choice:
        fields["tool_choice"] = _chat_tool_choice(choice)
        fields["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    return translated_chat_request(fields, body.model_extra, "messages")


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if "input_schema" not in tool or not tool.get("name"):
        raise bad_request("a tool needs a name and an input_schema (client tools only)", "tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> Any:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice type must be auto, any, tool (with a name) or none", "tool_choice")


async def create_message(state: ServerState, body: MessagesRequest, request: Request) -> Response:
    prepared = await prepare_chat(state, chat_request(body))
    shape = _MessageShape(state, len(prepared.prompt.token_ids))
    if body.stream:
        return StreamingResponse(_sse(_events(shape, prepared)), media_type="text/event-stream")
    results = await collect_results(prepared.generation, request)
    if results is None:
        return Response(status_code=499)
    (result,) = results
    message = prepared.chat.message(result.text)
    blocks = shape.blocks(message)
    stop_reason, stop_sequence = shape.stop(result.finish_reason, result.stop_reason, message)
    return JSONResponse(shape.message(blocks, stop_reason, stop_sequence, len(result.token_ids)))


async def count_tokens(state: ServerState, body: CountTokensRequest) -> dict[str, int]:
    state.check_model(body.model)
    chat = chat_messages(body.system, body.messages)
    tools = [_chat_tool(tool) for tool in body.tools] if body.tools else None
    try:
        messages = [ChatMessage(**message) for message in chat]
    except ValueError as error:
        raise bad_request(f"messages: {error}", "messages") from None
    prompt = await chat_prompt(state, messages, True, None, tools)
    return {"input_tokens": len(prompt.token_ids)}


class _MessageShape:
    def __init__(self, state: ServerState, num_prompt_tokens: int) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = state.settings.served_model_name
        self.num_prompt_tokens = num_prompt_tokens

    def message(
        self, blocks: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None, num_output: int
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": self.num_prompt_tokens, "output_tokens": num_output},
        }

    @staticmethod
    def blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
        blocks = []
        if message.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        blocks += [_tool_use(call) for call in message.get("tool_calls", [])]
        return blocks

    @staticmethod
    def stop(finish_reason: str | None, stop_reason: Any, message: dict[str, Any]) -> tuple[str | None, str | None]:
        if message.get("tool_calls") and finish_reason == "stop":
            return "tool_use", None
        if finish_reason == "stop" and isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return STOP_REASONS.get(finish_reason or "", finish_reason), None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": f"toolu_{call['id'].removeprefix('call_')}",
        "name": call["function"]["name"],
        "input": arguments,
    }


async def _events(shape: _MessageShape, prepared: Any) -> AsyncIterator[dict[str, Any]]:
    """message_start, then content blocks (thinking and text deltas as they come, each tool_use
    once its call is complete), then message_delta with the stop reason, and message_stop."""
    yield {"type": "message_start", "message": shape.message([], None, None, 0)}
    deltas, blocks = ChatDeltas(prepared.chat), _BlockStream()
    text, num_tokens, finish_reason, stop_reason = "", 0, None, None
    async for _, delta in prepared.generation.stream():
        text += delta.new_text
        num_tokens += len(delta.new_token_ids)
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        for event in blocks.events(deltas.push(delta.new_text, final=finish_reason is not None)):
            yield event
    for event in blocks.close():
        yield event
    reason, sequence = shape.stop(finish_reason, stop_reason, prepared.chat.message(text))
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"output_tokens": num_tokens},
    }
    yield {"type": "message_stop"}


class _BlockStream:
    def __init__(self) -> None:
        self.open: str | None = None  # "thinking" or "text": the block now streaming
        self.index = -1

    def events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if delta.get("reasoning_content"):
            events += self._piece("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            events += self._piece("text", {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", []):
            events += self._close()
            self.index += 1
            block = _tool_use(call)
            partial = json.dumps(block["input"], ensure_ascii=False)
            events += [
                {"type": "content_block_start", "index": self.index, "content_block": {**block, "input": {}}},
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": partial},
                },
                {"type": "content_block_stop", "index": self.index},
            ]
        return events

    def _piece(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events += self._close()
            self.open, self.index = kind, self.index + 1
            start = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events.append({"type": "content_block_start", "index": self.index, "content_block": start})
        events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def close(self) -> list[dict[str, Any]]:
        return self._close()


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    except (RequestRejected, EngineDeadError) as error:  # the stream has begun: an error event ends it
        kind = "invalid_request_error" if isinstance(error, RequestRejected) else "overloaded_error"
        body = {"type": "error", "error": {"type": kind, "message": str(error)}}
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
