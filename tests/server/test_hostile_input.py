"""Hostile and careless input over a real socket: every answer in OpenAI's error shape, with
the right status and the field named, and the server still serving afterwards."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, ServerProcess


def send(server: ServerProcess, method: str, path: str, content: bytes | None = None, **kwargs) -> httpx.Response:
    headers = {"Content-Type": "application/json", **server.headers, **kwargs.pop("headers", {})}
    return httpx.request(method, f"{server.base_url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    if param != "__any__":
        assert error["param"] == param, error
    return error


def still_serving(server: ServerProcess) -> None:
    body = b'{"prompt": "still here", "max_tokens": 2}'
    assert send(server, "POST", "/v1/completions", body).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "messages"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400(server, path, body, param):
    headers = {"Content-Type": "application/json", **server.headers}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
        error = assert_error(client.post(path, content=body), 400, param)
        assert "not valid Unicode" in error["message"]
        # The same kept-alive connection still answers.
        assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_framework_errors_come_in_openai_shape(server):
    assert_error(send(server, "GET", "/v1/completions"), 405)
    assert_error(send(server, "GET", "/v1/no-such-route"), 404)
    assert_error(send(server, "POST", "/v1/completions", b"\xff\xfe not json"), 400)
    assert_error(send(server, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400)
    still_serving(server)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'),
        # Echoed back in the response: Python's parser took NaN here, and rendering failed (a 500).
        ("/v1/responses", b'{"input": "x", "max_output_tokens": 1, "text": {"format": {"type": "text", "name": NaN}}}'),
        ("/v1/messages", b'{"max_tokens": -Infinity, "messages": [{"role": "user", "content": "x"}]}'),
        ("/v1/responses", b'{"input": "x", "max_output_tokens": 1, "metadata": {"a": 1e400}}'),  # inf once read
    ],
)
def test_nan_and_infinity_are_not_json(server, path, body):
    response = send(server, "POST", path, body)
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.text and any(word in response.text for word in ("NaN", "Infinity", "1e400"))
    still_serving(server)


def test_an_unreadable_body_says_where_it_stopped_being_json(server):
    error = assert_error(send(server, "POST", "/v1/completions", b'{"prompt": "x",'), 400, None)
    expected = "the body is not valid JSON: Expecting property name enclosed in double quotes (character 15)"
    assert error["message"] == expected


def test_a_request_that_could_never_be_admitted_is_a_400(server):
    error = assert_error(send(server, "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 1, "n": 10000}'), 400)
    assert error["param"] == "n" and "at most" in error["message"]


def test_tokenize_and_detokenize_need_the_key(server):
    for path, body in (("/tokenize", b'{"prompt": "hi"}'), ("/detokenize", b'{"tokens": [1, 2]}')):
        assert_error(send(server, "POST", path, body, headers={"Authorization": "Bearer wrong"}), 401)
        assert send(server, "POST", path, body).status_code == 200


def test_model_by_id_and_errors_name_their_field(server):
    card = send(server, "GET", f"/v1/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert_error(send(server, "GET", "/v1/models/other-model"), 404, "model")
    long_prompt = b'{"prompt": [' + b",".join([b"5"] * 5000) + b'], "max_tokens": 1}'
    assert_error(send(server, "POST", "/v1/completions", long_prompt), 400, "prompt")
    assert_error(send(server, "POST", "/v1/completions", b'{"prompt": "x", "temperature": -1}'), 400, "temperature")
    untyped_format = b'{"prompt": "x", "response_format": {"schema": {}}}'
    assert_error(send(server, "POST", "/v1/completions", untyped_format), 400, "response_format")
    unknown_token = send(server, "POST", "/detokenize", b'{"tokens": [1, 99999999]}')
    assert_error(unknown_token, 400, "tokens")
    assert "tokens out of range" in unknown_token.json()["error"]["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("best_of", 3),
        ("guided_whitespace_pattern", " "),
        ("priority", 5),
        ("prompt_logprobs", 1),
        ("cache_salt", "tenant-a"),
        ("chat_template", "{{ messages[0].content }}"),
        ("continue_final_message", True),
        ("echo", True),
        ("add_special_tokens", True),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
        ("functions", [{"name": "get_weather", "parameters": {"type": "object"}}]),
    ],
)
def test_fields_kestrel_does_not_implement_are_refused_by_name(server, field, value):
    import json

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    error = assert_error(send(server, "POST", "/v1/chat/completions", json.dumps(body).encode()), 400, field)
    assert "not supported" in error["message"]


HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
        ("/v1/responses", {"input": "hi", "background": True}, "background"),
        ("/v1/responses", {"input": "hi", "truncation": "auto"}, "truncation"),
        ("/v1/responses", {"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ("/v1/responses", {"input": "hi", "conversation": "conv_1"}, "conversation"),
        ("/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
        ("/v1/messages", {"messages": HELLO, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ("/v1/messages", {"messages": HELLO, "container": "c_1"}, "container"),
    ],
)
def test_each_endpoint_refuses_what_it_does_not_implement(server, path, body, field):
    import json

    response = send(server, "POST", path, json.dumps({**body, "max_tokens": 2}).encode())
    if path == "/v1/messages":  # Anthropic's error shape, which names no param
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        error = response.json()["error"]
    else:
        error = assert_error(response, 400, field)
    assert "not supported" in error["message"] and field in error["message"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "tools", [TOOL]),
        ("/v1/completions", "tool_choice", "required"),
        ("/v1/completions", "max_completion_tokens", 5),
        ("/v1/completions", "top_logprobs", 3),
        ("/v1/completions", "reasoning_effort", "low"),
        ("/v1/completions", "chat_template_kwargs", {"enable_thinking": False}),
        ("/v1/chat/completions", "prompt", "hello"),
        ("/v1/chat/completions", "suffix", "!"),
    ],
)
def test_the_other_endpoints_fields_are_refused_where_they_would_be_ignored(server, path, field, value):
    import json

    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(send(server, "POST", path, json.dumps({**body, "max_tokens": 2, field: value}).encode()), 400)
    assert error["param"] == field and "which this endpoint does not take" in error["message"]
    # Their values that ask for nothing pass.
    quiet = {"tools": [], "tool_choice": "none", "top_logprobs": 0}
    if field in quiet:
        response = send(server, "POST", path, json.dumps({**body, "max_tokens": 2, field: quiet[field]}).encode())
        assert response.status_code == 200, response.text


def test_fields_that_ask_for_nothing_are_accepted(server):
    import json

    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "priority": 0,
        "add_special_tokens": False,
        "spaces_between_special_tokens": True,
    }
    assert send(server, "POST", "/v1/chat/completions", json.dumps(body).encode()).status_code == 200


def test_tool_call_history_reaches_the_template(server):
    import json

    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {"messages": history, "max_tokens": 2}
    assert send(server, "POST", "/v1/chat/completions", json.dumps(body).encode()).status_code == 200
    broken = json.loads(json.dumps(body))
    broken["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert_error(send(server, "POST", "/v1/chat/completions", json.dumps(broken).encode()), 400, "messages")


def test_an_oversized_body_is_a_413_and_a_big_prompt_does_not_stall_health(server_model):
    server = ServerProcess(server_model, "--max-request-body-mb", "4")
    try:
        assert_error(send(server, "POST", "/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}'), 413)
        big = b'{"prompt": "' + b"hello world " * 250_000 + b'", "max_tokens": 1}'  # 3 MB, seconds to tokenize
        answers: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: answers.append(send(server, "POST", "/v1/completions", big)))
        worker.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        health_seconds = time.monotonic() - start
        worker.join()
        assert_error(answers[0], 400, "prompt")  # longer than the context window
        assert health_seconds < 2.0
    finally:
        server.stop()


def test_health_is_503_while_draining(server_model):
    server = ServerProcess(server_model, "--shutdown-timeout", "20")
    try:
        body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True}
        stream = threading.Thread(
            target=lambda: httpx.post(
                f"{server.base_url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=60,
            )
        )
        stream.start()
        time.sleep(0.5)
        server.terminate()
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline and status != 503:
            status = httpx.get(f"{server.base_url}/health", timeout=5).status_code
            time.sleep(0.05)
        assert status == 503
        stream.join()
    finally:
        server.stop()


def test_logit_bias_and_allowed_token_ids_over_http(server):
    import json

    def piece(token: int) -> str:
        return send(server, "POST", "/detokenize", json.dumps({"tokens": [token]}).encode()).json()["prompt"]

    token = next(t for t in range(300, 400) if piece(t).strip().isalpha())  # a plain word piece
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}}
    answer = send(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == piece(token) * 4
    token_text = piece(token)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}}
    body["bad_words"] = [token_text]  # the word the bias pushes for can no longer come
    banned = send(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert banned.status_code == 200 and token_text not in banned.json()["choices"][0]["text"]
    body = {"prompt": "Hello", "max_tokens": 4, "allowed_token_ids": [10**7]}
    assert_error(send(server, "POST", "/v1/completions", json.dumps(body).encode()), 400, "allowed_token_ids")
    body = {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"x": 1}}
    assert_error(send(server, "POST", "/v1/completions", json.dumps(body).encode()), 400, "logit_bias")


def test_return_tokens_as_token_ids_names_every_token_by_id(server):
    import json

    body = {"prompt": "Hello", "max_tokens": 4, "logprobs": 3, "return_tokens_as_token_ids": True, "ignore_eos": True}
    logprobs = send(server, "POST", "/v1/completions", json.dumps(body).encode()).json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 and all(t.startswith("token_id:") for t in logprobs["tokens"])
    for chosen, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert len(top) == 3 and all(key.startswith("token_id:") for key in top)  # ids never collide
        assert int(chosen.removeprefix("token_id:")) >= 0
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    content = send(server, "POST", "/v1/chat/completions", json.dumps(chat).encode()).json()["choices"][0]
    assert all(entry["token"].startswith("token_id:") for entry in content["logprobs"]["content"])


def test_logprob_offsets_add_up_and_bytes_rebuild_the_text(server):
    import json

    body = {"prompt": "Café 東京 🙂", "max_tokens": 40, "logprobs": 1, "temperature": 1.0, "seed": 7, "echo": True}
    body["ignore_eos"] = True
    choice = send(server, "POST", "/v1/completions", json.dumps(body).encode()).json()["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])
    assert len(set(offsets)) > len(offsets) // 2  # they move with the text, not all zeros
    chat = {"messages": [{"role": "user", "content": "Café 🙂"}], "max_tokens": 40, "logprobs": True, "seed": 3}
    chat["ignore_eos"] = True
    message = send(server, "POST", "/v1/chat/completions", json.dumps(chat).encode()).json()["choices"][0]
    from kestrel.demo import SPECIAL_TOKENS  # skipped in the text, so left out of the bytes too

    pieces = [entry for entry in message["logprobs"]["content"] if entry["token"] not in SPECIAL_TOKENS]
    rebuilt = b"".join(bytes(entry["bytes"]) for entry in pieces)
    assert rebuilt.decode("utf-8", errors="replace").rstrip("\ufffd") == message["message"]["content"].rstrip("\ufffd")
