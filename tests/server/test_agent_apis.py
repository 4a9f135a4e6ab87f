"""The Responses API (official `openai` client) and the Messages API (official `anthropic`
client) on the demo model, over the same engine as chat completions: text, structured output,
forced and parsed tool calls, tool results sent back, streaming, token counting and errors."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.server.conftest import SMOLLM2
from tests.server.test_structured_outputs import literal_regex

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def openai_client(smollm2_server):
    return openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def anthropic_client(smollm2_server):
    return anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="unused")


# ---- Responses ------------------------------------------------------------------------------


def test_responses_text_and_structured_output(openai_client):
    response = openai_client.responses.create(
        model=SMOLLM2, input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens <= 12 and response.usage.input_tokens > 0
    structured = openai_client.responses.create(
        model=SMOLLM2,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a city, as JSON."}]}],
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
        max_output_tokens=60,
        store=False,
    )
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), CITY)


def test_responses_tool_calls_and_results(openai_client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    response = openai_client.responses.create(
        model=SMOLLM2,
        input=question,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # a small model would list calls until max_output_tokens
        max_output_tokens=80,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    follow_up = question + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees, sunny"},
    ]
    answer = openai_client.responses.create(model=SMOLLM2, input=follow_up, tools=tools, max_output_tokens=16)
    assert answer.output_text and not [item for item in answer.output if item.type == "function_call"]


def test_responses_stream_events(openai_client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}]
    events = list(
        openai_client.responses.create(
            model=SMOLLM2,
            input="Weather in Paris?",
            tools=tools,
            tool_choice="auto",
            max_output_tokens=100,
            stream=True,
            extra_body={"guided_regex": literal_regex("Checking. " + HERMES_CALL)},
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text.strip() == "Checking."
    (done,) = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris", "unit": "celsius"}
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]


def test_responses_refuse_what_they_cannot_do(openai_client):
    for fields, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, "text"),
    ]:
        with pytest.raises(openai.BadRequestError) as raised:
            openai_client.responses.create(model=SMOLLM2, input="hi", max_output_tokens=4, **fields)
        assert raised.value.body["param"] == param


# ---- Messages -------------------------------------------------------------------------------


def test_messages_text_stop_reasons_and_count_tokens(anthropic_client):
    message = anthropic_client.messages.create(
        model=SMOLLM2, max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Count to ten."}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 8
    counted = anthropic_client.messages.count_tokens(
        model=SMOLLM2, system="Be brief.", messages=[{"role": "user", "content": "Count to ten."}]
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_messages_tool_use_round_trip(anthropic_client):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_PARAMETERS}]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    message = anthropic_client.messages.create(
        model=SMOLLM2,
        max_tokens=80,
        messages=question,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_PARAMETERS)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "22 C, sunny"}]}
    follow_up = question + [
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [result]},
    ]
    answer = anthropic_client.messages.create(model=SMOLLM2, max_tokens=16, messages=follow_up, tools=tools)
    assert answer.content and answer.content[0].type == "text"


def test_messages_stream_text_and_tool_use(anthropic_client):
    tools = [{"name": "get_weather", "input_schema": WEATHER_PARAMETERS}]
    with anthropic_client.messages.stream(
        model=SMOLLM2,
        max_tokens=100,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        extra_body={"guided_regex": literal_regex("Checking. " + HERMES_CALL)},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[0].text.strip() == "Checking."
    assert final.content[1].input == {"city": "Paris", "unit": "celsius"}
    assert final.stop_reason == "tool_use"


def test_messages_errors_take_anthropic_shape(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client.messages.create(
            model=SMOLLM2, max_tokens=4, messages=[{"role": "user", "content": "x"}], tool_choice={"type": "any"}
        )
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "needs tools" in raised.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "x"}])


# ---- Malformed payloads: a 400 naming the field, never a 500 ----------------------------------

MALFORMED = [5, True, {"a": 1}, [5], ["x"], [{"type": "text", "text": 5}]]


@pytest.mark.parametrize("value", MALFORMED)
def test_malformed_responses_and_messages_payloads_are_400s(smollm2_server, value):
    import httpx

    url = smollm2_server.base_url
    payloads = [
        ("/v1/responses", {"input": [{"role": "user", "content": value}], "max_output_tokens": 2}, "input"),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "1", "output": value}]}, "input"),
        ("/v1/responses", {"input": "hi", "text": {"format": value}, "max_output_tokens": 2}, "text"),
        ("/v1/messages", {"messages": [{"role": "user", "content": value}], "max_tokens": 2}, None),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "system": [value], "max_tokens": 2}, None),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": value}]}], "max_tokens": 2},
            None,
        ),
    ]
    for path, body, param in payloads:  # param: the field a Responses error names
        response = httpx.post(f"{url}{path}", json={"model": SMOLLM2, **body}, timeout=30)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        if path == "/v1/messages":  # Anthropic's shape: a type, no param
            assert error["type"] == "invalid_request_error", response.text
        else:
            assert error["param"].startswith(param), response.text
