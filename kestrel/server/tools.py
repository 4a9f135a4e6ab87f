"""Tool calling and reasoning in chat answers: which tools a request may call and how, the
grammar that enforces a forced call, and the assistant message (or stream deltas) an output
becomes once reasoning and tool calls are split out of its text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.engine.reasoning import ReasoningFormat, ReasoningStream
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.server.protocol import ChatCompletionRequest, Tool, bad_request
from kestrel.server.tool_parsers import ParsedToolCall, ToolCallParser, calls_from_text


@dataclass(frozen=True)
class ToolChoice:
    """How this request uses its tools: "none", "auto" (the parser finds calls in free text),
    "required" (a grammar forces one or more calls) or "named" (a grammar forces `name`)."""

    mode: str
    name: str | None = None


NO_TOOLS = ToolChoice("none")


def resolve_tool_choice(body: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolChoice:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    if choice is None:  # OpenAI's default with tools, where this server can parse them
        return ToolChoice("auto") if parser is not None else NO_TOOLS
    if choice == "auto" and parser is None:
        raise bad_request(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser',
            "tool_choice",
        )
    if isinstance(choice, str):
        return ToolChoice(choice)
    names = [tool.function.name for tool in body.tools]
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("named", choice.function.name)


def tool_constraint(choice: ToolChoice, tools: list[Tool], parallel: bool) -> StructuredOutputsParams | None:
    """The grammar of a forced call: the named function's arguments, or (required) a JSON
    list of `{"name", "parameters"}` calls, one at most unless parallel calls are allowed."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.function.name == choice.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if choice.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatFormat:
    """How an output's text becomes an assistant message."""

    choice: ToolChoice = NO_TOOLS
    parser: ToolCallParser | None = None
    reasoning: ReasoningFormat | None = None
    parallel_calls: bool = True  # False: only the first call the parser finds counts

    def message(self, text: str) -> dict[str, Any]:
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        content, calls = self.split_calls(content, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message

    def split_calls(self, content: str, final: bool) -> tuple[str, tuple[ParsedToolCall, ...]]:
        mode = self.choice.mode
        if mode == "named":
            return "", (ParsedToolCall(self.choice.name, content.strip()),) if final else ()
        if mode == "required":
            calls = calls_from_text(content) if final else None
            return ("", calls) if calls else ("" if not final else content, ())
        if mode == "auto":
            parsed = self.parser.parse(content, final)
            return parsed.content, parsed.tool_calls if self.parallel_calls else parsed.tool_calls[:1]
        return content, ()


class ChatDeltas:
    """One streamed choice: each piece of text becomes a chat delta (reasoning, content and
    tool calls as they complete; a named call's arguments as they are written)."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self._reasoning = ReasoningStream(chat.reasoning) if chat.reasoning else None
        self._content = ""
        self._sent_content = 0
        self._sent_calls = 0
        self.num_calls = 0

    def push(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = self._reasoning.push(text, final) if self._reasoning else ("", text)
        self._content += content
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if self.chat.choice.mode == "named":
            self._named_delta(content, delta)
            return delta
        content_so_far, calls = self.chat.split_calls(self._content, final)
        if content_so_far[self._sent_content :]:
            delta["content"] = content_so_far[self._sent_content :]
            self._sent_content = len(content_so_far)
        if calls[self._sent_calls :]:
            delta["tool_calls"] = [call.openai(i) for i, call in enumerate(calls) if i >= self._sent_calls]
            self._sent_calls = self.num_calls = len(calls)
        return delta

    def _named_delta(self, content: str, delta: dict[str, Any]) -> None:
        if self.num_calls == 0:
            opening = ParsedToolCall(self.chat.choice.name, content).openai(0)
            delta["tool_calls"] = [opening]
            self.num_calls = 1
        elif content:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": content}}]
