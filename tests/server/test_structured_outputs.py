"""Structured outputs and tool calls over HTTP, with the official `openai` client, on the real
demo model (SmolLM2-135M-Instruct): every JSON answer validates against its schema, streamed
or not; forced tool calls always parse; bad schemas are a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import SMOLLM2, ServerProcess
from tests.server.schemas import SCHEMAS

MODEL = SMOLLM2
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def literal_regex(text: str) -> str:
    """A regular expression matching exactly `text`."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")


def chat_request(name: str, prompt: str, schema: dict) -> dict:
    return dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}],
        max_tokens=200,
        temperature=0.7,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    )


async def answer(client: openai.AsyncOpenAI, request: dict, stream: bool) -> tuple[str, str]:
    if not stream:
        response = await client.chat.completions.create(**request)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, finish_reason = "", None
    async for chunk in await client.chat.completions.create(stream=True, **request):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    return text, finish_reason


def test_every_schema_answer_validates_streamed_or_not(server):
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        requests = [
            (name, schema, stream, chat_request(name, prompt, schema))
            for name, (prompt, schema) in SCHEMAS.items()
            for stream in (False, True)
        ]
        answers = await asyncio.gather(*(answer(client, request, stream) for *_, stream, request in requests))
        return [(name, schema, stream, *reply) for (name, schema, stream, _), reply in zip(requests, answers)]

    results = asyncio.run(run())
    assert len(results) == 2 * len(SCHEMAS) >= 44
    for name, schema, _, text, finish_reason in results:
        assert finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)
    by_mode = {(name, stream): text for name, _, stream, text, _ in results}
    for name in SCHEMAS:  # the same seed: the stream carries the same answer
        assert by_mode[(name, True)] == by_mode[(name, False)]


def test_vllm_fields_and_completions(client):
    choices = ["red", "green", "blue"]
    for seed in range(4):
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Pick a color."}],
            max_tokens=8,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert response.choices[0].message.content in choices
    pattern = r"[0-9]{3}-[0-9]{4}"
    completion = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, extra_body={"structured_outputs": {"regex": pattern}}
    )
    assert re.fullmatch(pattern, completion.choices[0].text)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    response = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=12, extra_body={"guided_grammar": grammar}
    )
    assert re.fullmatch(r"The answer is (yes|no)\.", response.choices[0].message.content)
    response = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=120, response_format={"type": "json_object"}, temperature=0
    )
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_metrics_count_constrained_requests_and_compile_time(server, client):
    client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=4, extra_body={"guided_regex": "[a-z]+"}
    )
    metrics = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{server.base_url}/metrics").text.splitlines()
        if line.startswith("kestrel:") and MODEL in line
    }
    assert metrics["kestrel:structured_output_requests_total"] >= 1
    assert metrics["kestrel:grammar_compilations_total"] >= 1
    assert metrics["kestrel:grammar_compile_seconds_total"] > 0
    assert metrics["kestrel:grammar_mask_seconds_total"] > 0


def test_required_and_named_tool_choice_always_parse(client):
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=seed > 0,  # parallel: a list of calls, which a small model may not end
            max_tokens=200,
            seed=seed,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])


def test_tool_calls_stream_as_openai_deltas(client):
    """A named call streams its arguments as they are written; the pieces join into the
    arguments of the same request answered whole."""
    request = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    pieces, names, finish = [], [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            names += [delta.function.name] if delta.function.name else []
            pieces.append(delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert "".join(pieces) == whole.function.arguments


def test_auto_tool_choice_parses_calls_from_text(client):
    """With "auto", the hermes parser finds `<tool_call>` blocks in free text (the text is
    forced here by a regex, so the test does not depend on what the small model prefers)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    request = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=100,
        extra_body={"guided_regex": literal_regex("Let me check. " + call)},
    )
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content.strip() == "Let me check."
    (parsed,) = message.tool_calls
    assert parsed.function.name == "get_weather"
    assert json.loads(parsed.function.arguments) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format",
            'Unsupported type "objectx"',
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs a schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
        ({"guided_regex": "a(b"}, "guided_regex", "parenthesis is not closed"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF parser error"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown fields: jsn"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "not available"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "one output constraint"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4, extra_body=fields)
    error = raised.value.body
    assert error["param"] == param and says in error["message"], error
    assert client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2).choices  # still serving


def test_reasoning_content_is_split_out_streamed_or_not(server_model):
    """deepseek_r1's format: an output is reasoning until `</think>`; the tiny random model
    never writes it, so all of its (greedy) answer is reasoning, the same streamed or not, and
    a grammar would only start after it."""
    process = ServerProcess(server_model, "--reasoning-parser", "deepseek_r1", api_key=None)
    try:
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused")
        request = dict(model="tiny-qwen3", messages=ASK_WEATHER, max_tokens=12, temperature=0)
        message = client.chat.completions.create(**request).choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning and "</think>" not in reasoning and not message.content
        streamed = ""
        for chunk in client.chat.completions.create(stream=True, **request):
            delta = chunk.choices[0].delta if chunk.choices else None
            streamed += (delta.model_extra or {}).get("reasoning_content") or "" if delta else ""
            assert not (delta and delta.content)
        assert streamed == reasoning
    finally:
        process.stop()
