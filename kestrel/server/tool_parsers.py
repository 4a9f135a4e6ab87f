"""Tool-call parsers: the formats models write tool calls in (vLLM's `--tool-call-parser` names).

A parser splits a model's output into plain content and tool calls. `parse(text, final=False)`
reads an output still being generated: it returns the calls complete so far and the content
that can no longer turn out to be part of a call, so a stream can send both as they come.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    tool_calls: tuple[ParsedToolCall, ...] = ()


def call_from_json(value: Any) -> ParsedToolCall | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}`; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(value["name"], arguments)


def json_values(text: str) -> list[Any] | None:
    """The JSON values `text` holds one after another (separated by whitespace, `,` or `;`);
    None unless all of it is JSON."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.append(value)


def calls_from_text(text: str) -> tuple[ParsedToolCall, ...] | None:
    """Calls from JSON text holding call objects, or lists of them; None if anything else."""
    values = json_values(text)
    if not values:
        return None
    flat = [item for value in values for item in (value if isinstance(value, list) else [value])]
    calls = [call_from_json(item) for item in flat]
    return None if not calls or None in calls else tuple(calls)


def hold_partial_marker(text: str, marker: str) -> str:
    """`text` without a trailing piece that could be the start of `marker`."""
    for cut in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-cut:]):
            return text[:-cut]
    return text


class ToolCallParser(ABC):
    # Whether the output must keep special tokens: where the call markers are special
    # tokens, skipping them would hide the calls.
    keeps_special_tokens = False

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> ParsedOutput: ...


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, between text
    (Hermes, Qwen2.5, Qwen3)."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        content, calls, position = [], [], 0
        while (start := text.find(self.start, position)) >= 0:
            content.append(text[position:start])
            end = text.find(self.end, start)
            body = text[start + len(self.start) : end if end >= 0 else len(text)]
            found = calls_from_text(body) if end >= 0 or final else None
            if end < 0 and not final:
                return ParsedOutput("".join(content), tuple(calls))  # a call still being written
            if found is None:
                content.append(text[start : end + len(self.end) if end >= 0 else len(text)])
            else:
                calls.extend(found)
            position = end + len(self.end) if end >= 0 else len(text)
        tail = text[position:]
        content.append(tail if final else hold_partial_marker(tail, self.start))
        return ParsedOutput("".join(content), tuple(calls))


class Llama3JsonParser(ToolCallParser):
    """A whole output of JSON calls, `{"name": ..., "parameters": {...}}`, `;`-separated,
    optionally after `<|python_tag|>` (Llama 3.1 and later)."""

    tag = "<|python_tag|>"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        stripped = text.lstrip()
        body = stripped.removeprefix(self.tag).lstrip()
        looks_like_calls = body.startswith(("{", "["))
        if not final:
            undecided = not stripped or self.tag.startswith(stripped)  # may yet be the tag
            return ParsedOutput("" if undecided or looks_like_calls else text)
        calls = calls_from_text(body) if looks_like_calls else None
        return ParsedOutput(text) if calls is None else ParsedOutput("", calls)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` then a JSON list of calls (`[{"name", "arguments"}]`), or, in newer
    tokenizers, `name[ARGS]{...}` per call."""

    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        start = text.find(self.marker)
        if start < 0:
            return ParsedOutput(text if final else hold_partial_marker(text, self.marker))
        content = text[:start]
        if not final:
            return ParsedOutput(content)
        calls = self._calls(text[start:])
        return ParsedOutput(text) if calls is None else ParsedOutput(content, calls)

    def _calls(self, text: str) -> tuple[ParsedToolCall, ...] | None:
        pieces = [piece.strip() for piece in text.split(self.marker) if piece.strip()]
        calls: list[ParsedToolCall] = []
        for piece in pieces:
            if self.args_marker in piece:
                name, arguments = piece.split(self.args_marker, 1)
                values = json_values(arguments)
                if not name.strip() or not values or len(values) != 1:
                    return None
                calls.append(ParsedToolCall(name.strip(), json.dumps(values[0], ensure_ascii=False)))
            else:
                found = calls_from_text(piece)
                if found is None:
                    return None
                calls.extend(found)
        return tuple(calls) or None


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
