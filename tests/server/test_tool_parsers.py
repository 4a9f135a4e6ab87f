"""Tool-call and reasoning parsing, whole and streamed piece by piece (no server needed)."""

from __future__ import annotations

import json

import pytest

from kestrel.engine.reasoning import REASONING_PARSERS, ReasoningStream
from kestrel.server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from kestrel.server.tools import ChatDeltas, ChatFormat, ToolChoice

HERMES = (
    'Sure.<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
)


def names_and_arguments(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (HermesParser(), HERMES, "Sure.\n", [("get", {"city": "Paris"}), ("time", {})]),
        (HermesParser(), "no calls here", "no calls here", []),
        (HermesParser(), "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
        (
            Llama3JsonParser(),
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
            "",
            [("a", {"x": 1}), ("b", {})],
        ),
        (Llama3JsonParser(), "Hello there", "Hello there", []),
        (Llama3JsonParser(), '{"not": "a call"}', '{"not": "a call"}', []),
        (MistralParser(), 'Hi [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', "Hi ", [("a", {"x": 1})]),
        (MistralParser(), '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', "", [("a", {"x": 1}), ("b", {})]),
        (MistralParser(), '[TOOL_CALLS]a[ARGS]{"x": 1', '[TOOL_CALLS]a[ARGS]{"x": 1', []),
    ],
)
def test_parsers_split_content_from_calls(parser, text, content, calls):
    parsed = parser.parse(text)
    assert parsed.content == content
    assert names_and_arguments(parsed.tool_calls) == calls


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()])
def test_streamed_pieces_add_up_to_the_whole_parse(parser):
    texts = [
        HERMES,
        "plain words only",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}]',
        '{"name": "f", "parameters": {}}',
    ]
    for text in texts:
        deltas = ChatDeltas(ChatFormat(ToolChoice("auto"), parser))
        content, calls = "", []
        for index in range(0, len(text), 3):  # three characters at a time
            delta = deltas.push(text[index : index + 3], final=index + 3 >= len(text))
            content += delta.get("content", "")
            calls += delta.get("tool_calls", [])
        whole = parser.parse(text)
        assert content == whole.content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_a_message_with_calls_has_no_content_and_its_reasoning_apart():
    chat = ChatFormat(ToolChoice("auto"), HermesParser(), REASONING_PARSERS["qwen3"])
    message = chat.message("<think>\nweather needs a tool\n</think>\n\n" + HERMES.removeprefix("Sure."))
    assert message["reasoning_content"] == "\nweather needs a tool\n"
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get", "time"]
    named = ChatFormat(ToolChoice("named", "get")).message('{"city": "Oslo"}')
    assert named["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"city": "Oslo"}'}
    required = ChatFormat(ToolChoice("required")).message('[{"name": "get", "parameters": {"city": "Rome"}}]')
    assert names_and_arguments_of(required) == [("get", {"city": "Rome"})]


def test_without_parallel_calls_only_the_first_counts():
    chat = ChatFormat(ToolChoice("auto"), HermesParser(), parallel_calls=False)
    assert [c["function"]["name"] for c in chat.message(HERMES)["tool_calls"]] == ["get"]


def names_and_arguments_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>plan</think>answer", "plan", "answer"),
        ("qwen3", "just an answer", None, "just an answer"),
        ("qwen3", "<think>still thinking", "still thinking", ""),
        ("deepseek_r1", "plan</think>answer", "plan", "answer"),
        ("deepseek_r1", "thinking, cut short", "thinking, cut short", ""),
    ],
)
def test_reasoning_splits_whole_and_streamed(name, text, reasoning, content):
    reasoning_format = REASONING_PARSERS[name]
    assert reasoning_format.split(text) == (reasoning, content)
    stream = ReasoningStream(reasoning_format)
    pieces = [stream.push(text[i : i + 2], final=i + 2 >= len(text)) for i in range(0, len(text), 2)]
    assert "".join(p[0] for p in pieces) == (reasoning or "")
    assert "".join(p[1] for p in pieces) == content
