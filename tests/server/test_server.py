"""The real server over a socket: endpoints, fields, streaming, errors, aborts, load."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, SERVER_ARGS, ServerProcess


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def post(server, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers or server.headers, timeout=60)


def post_get(server, path: str) -> dict:
    return httpx.get(f"{server.base_url}{path}", headers=server.headers, timeout=60).json()


# ---- plain endpoints ------------------------------------------------------------------------


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server.base_url}/version").json()


def test_tokenize_detokenize_round_trip(server):
    tokens = post(server, "/tokenize", {"prompt": "Hello, world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == "Hello, world"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tokens["count"] - 5


# ---- completions and chat -------------------------------------------------------------------


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=20, temperature=0)
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert full.choices[0].text == streamed and len(streamed) > 0
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream_with_usage(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
        ],
        max_completion_tokens=16,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 16
    assert full.choices[0].message.role == "assistant"


def test_prompt_forms_and_n(server):
    ids = post(server, "/tokenize", {"prompt": "Hello"}).json()["tokens"]
    for prompt, expected in [("Hello", 1), (["Hello", "Bye"], 2), (ids, 1), ([ids, ids], 2)]:
        # ignore_eos: an unseeded draw may pick the end token, and the test is about the choices' shape.
        fields = {"max_tokens": 3, "n": 2, "temperature": 0.9, "ignore_eos": True, "unknown_field": True}
        body = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, **fields}).json()
        assert [c["index"] for c in body["choices"]] == list(range(2 * expected))
        assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once", max_tokens=12, temperature=1.0, seed=42, top_k=50, min_p=0.01)
    first = client.completions.create(
        **{k: v for k, v in kwargs.items() if k not in ("top_k", "min_p")}, extra_body={"top_k": 50, "min_p": 0.01}
    )
    second = client.completions.create(
        **{k: v for k, v in kwargs.items() if k not in ("top_k", "min_p")}, extra_body={"top_k": 50, "min_p": 0.01}
    )
    assert first.choices[0].text == second.choices[0].text


def test_echo_prompt_logprobs_legacy_format(server):
    prompt = "The quick brown fox jumps"
    body = post(
        server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    ).json()
    choice = body["choices"][0]
    n_prompt = body["usage"]["prompt_tokens"]
    assert choice["text"] == prompt
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n_prompt
    assert logprobs["token_logprobs"][0] is None and all(v <= 0 for v in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == prompt
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])


def test_prompt_logprobs_in_vllms_shape_agree_with_the_echoed_logprobs(server):
    prompt = "The quick brown fox jumps"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 3}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    entries, echoed = choice["prompt_logprobs"], choice["logprobs"]
    tokens = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert len(entries) == len(tokens) and entries[0] is None
    for token, entry, logprob in zip(tokens[1:], entries[1:], echoed["token_logprobs"][1:]):
        assert str(token) in entry and entry[str(token)]["logprob"] == logprob  # the prompt's own token
        assert 3 <= len(entry) <= 4  # and the three likeliest (one of which it may be)
        ranks = sorted(alternative["rank"] for alternative in entry.values())
        assert ranks[:3] == [1, 2, 3]
    streamed = dict(body, stream=True)
    assert post(server, "/v1/completions", streamed).status_code == 400


def test_each_prompt_of_a_request_fills_its_own_context_window(server):
    window = post_get(server, "/v1/models")["data"][0]["max_model_len"]
    short, long = [5] * (window // 2), [5] * (window - 8)  # the longer last: its room is the smaller
    body = {"model": MODEL_NAME, "prompt": [short, long], "max_tokens": None, "ignore_eos": True, "temperature": 0}
    answer = post(server, "/v1/completions", body).json()
    assert answer["usage"]["completion_tokens"] == 2 * window - len(short) - len(long)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    prompt = "The quick brown fox jumps over the lazy dog"
    tokens = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 3}
    answer = post(server, "/v1/completions", body).json()
    kept = post(server, "/detokenize", {"tokens": tokens[-3:]}).json()["prompt"]
    assert answer["usage"]["prompt_tokens"] == 3 and answer["choices"][0]["text"].startswith(kept)
    whole = post(server, "/v1/completions", dict(body, truncate_prompt_tokens=-1)).json()
    assert whole["usage"]["prompt_tokens"] == len(tokens)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    assert (
        post(server, "/v1/chat/completions", dict(chat, truncate_prompt_tokens=5)).json()["usage"]["prompt_tokens"] == 5
    )
    refused = post(server, "/v1/completions", dict(body, truncate_prompt_tokens=0))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)  # greedy picks the top


def test_stop_string_is_not_leaked_when_streaming(client):
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=30, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[6:10]
    full = client.completions.create(stop=[stop], **kwargs).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kwargs))
    assert full.text == streamed == free[: free.index(stop)]
    assert full.finish_reason == "stop"


# ---- errors ---------------------------------------------------------------------------------


def assert_error(response: httpx.Response, status: int, *fragments: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"]


def test_error_cases(server):
    url = f"{server.base_url}/v1/completions"
    broken = httpx.post(url, content=b"{not json", headers={**server.headers, "content-type": "application/json"})
    assert_error(broken, 400)
    assert_error(
        post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "temperature": -1}), 400, "temperature"
    )
    assert_error(post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": "many"}), 400)
    assert_error(post(server, "/v1/completions", {"model": MODEL_NAME}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": []}), 400)
    assert_error(post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": [10**7]}), 400, "out of range")
    long_prompt = [5] * 2000
    assert_error(
        post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 100}),
        400,
        "1024",
        "2000",
    )
    assert_error(
        post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}), 400, "1024", "5000"
    )
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}), 400)
    assert_error(post(server, "/v1/completions", {"model": "other", "prompt": "x"}), 404, "other")
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(f"{server.base_url}/v1/models"), 401)
    # The server is still fine afterwards.
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


# ---- aborts and load ------------------------------------------------------------------------


def wait_idle(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("kv_cache_used_pages") == 0 and server.metric("num_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("pages still in use after the client left")


def test_client_hanging_up_mid_stream_frees_its_pages(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers) as response:
        lines = response.iter_lines()  # kept referenced: dropping it closes the response
        for _ in range(5):
            next(lines)
        assert server.metric("kv_cache_used_pages") > 0
    wait_idle(server)


def test_client_hanging_up_non_streaming_frees_its_pages(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=1.0)
    wait_idle(server)


def test_hundred_concurrent_streams_all_complete(server):
    async def one(client: httpx.AsyncClient, index: int) -> int:
        body = {
            "model": MODEL_NAME,
            "prompt": f"request {index}",
            "max_tokens": 8 + index % 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
        return usage["completion_tokens"]

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    assert asyncio.run(run()) == [8 + i % 5 for i in range(100)]
    wait_idle(server)
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'kestrel:request_success_total{finished_reason="length",model_name="tiny-qwen3"}' in metrics
    assert "kestrel:time_to_first_token_seconds_count" in metrics


def test_concurrent_greedy_requests_answer_as_they_do_alone(server_model):
    """Batching must not mix up rows: each greedy completion sent among many others (streamed
    or not, prompts long enough to be prefilled in chunks beside decoding rows) gives the
    tokens it gives alone. The server caches no prefixes, so the concurrent round computes
    every prompt again (with a cache, the lone round's pages would leave it only decode rows).
    Batched and one-row steps sum in different orders on the CPU, so an answer may part from
    its lone one only where the lone one's top two tokens tie within rounding (a near-tie),
    after which the rest may differ."""
    prompts = [f"story {index}: " + "once upon a time " * (3 + 40 * (index % 3)) for index in range(12)]

    async def one(client: httpx.AsyncClient, prompt: str, stream: bool) -> list[tuple[str, dict]]:
        request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        request |= {"logprobs": 2, "stream": stream}
        if not stream:
            choice = (await client.post("/v1/completions", json=request)).json()["choices"][0]
            return list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]))
        steps = []
        async with client.stream("POST", "/v1/completions", json=request) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    logprobs = json.loads(line[6:])["choices"][0]["logprobs"] or {"tokens": [], "top_logprobs": []}
                    steps += list(zip(logprobs["tokens"], logprobs["top_logprobs"]))
        return steps

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120) as client:
            alone = [await one(client, prompt, stream=False) for prompt in prompts]
            together = await asyncio.gather(*(one(client, p, stream=i % 2 == 0) for i, p in enumerate(prompts)))
            return alone, together

    server = ServerProcess(server_model, *SERVER_ARGS, "--no-enable-prefix-caching")
    try:
        alone, together = asyncio.run(run())
        reused_tokens = server.metric("prefix_cache_hits_total")
    finally:
        server.stop()
    assert reused_tokens == 0, "the concurrent round reused the lone round's pages"
    for lone, batched in zip(alone, together):
        assert len(lone) == len(batched) == 8
        for (token, top), (other, _) in zip(lone, batched):
            if token != other:
                first, second = sorted(top.values(), reverse=True)[:2]
                assert first - second < 1e-3, f"{other!r} where alone gave {token!r} (margin {first - second})"
                break


def test_requests_preempted_for_pages_still_answer_in_full(server_model):
    """Six requests that each grow to 8 pages of 8 tokens, on a pool of 20 pages: the engine
    must preempt some of them (recomputing their KV later), and still every one answers with
    all its tokens; the metric counts the preemptions, and every page comes back."""
    import torch
    from transformers import AutoConfig

    from kestrel.core.state import KVCacheSpec

    config = AutoConfig.from_pretrained(server_model)
    page = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32, 8)
    pool = (
        "--kv-cache-memory-gb",
        str(20 * page.bytes_per_page() / 2**30),
        "--max-model-len",
        "96",
        "--dtype",
        "float32",
    )
    request = {"model": MODEL_NAME, "max_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120) as client:
            answers = [client.post("/v1/completions", json=request | {"prompt": f"tale {i}"}) for i in range(6)]
            return [response.json() for response in await asyncio.gather(*answers)]

    server = ServerProcess(server_model, *SERVER_ARGS, *pool)
    try:
        answers = asyncio.run(run())
        preemptions = server.metric("num_preemptions_total")
        wait_idle(server)
    finally:
        server.stop()
    assert preemptions > 0, "the pool held every request: nothing was preempted"
    for answer in answers:
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 60


def test_prefix_cache_metrics_count_reused_tokens(server):
    prompt = "A long shared system prompt that several requests begin with. " * 6
    for _ in range(2):
        post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2})
    hits_before = server.metric("prefix_cache_hits_total")
    post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt + "And then?", "max_tokens": 2})
    assert server.metric("prefix_cache_hits_total") > hits_before
    assert server.metric("prefix_cache_queries_total") >= server.metric("prefix_cache_hits_total")


def test_bench_serve_measures_this_server(server, tmp_path):
    import subprocess
    import sys

    result_json, png = tmp_path / "result.json", tmp_path / "latency.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kestrel",
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "12",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--max-concurrency",
            "4",
            "--request-rate",
            "50",
            "--vocab-size",
            "400",
            "--result-json",
            str(result_json),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(result_json.read_text())
    assert (result["completed"], result["failed"]) == (12, 0)
    assert result["output_token_throughput"] > 0 and result["ttft"]["median_ms"] > 0
    assert result["e2e"]["p99_ms"] >= result["e2e"]["median_ms"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_every_sampling_field_is_accepted_and_applied(server):
    base = {"model": MODEL_NAME, "prompt": "The the the", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", base).json()["choices"][0]
    fields = {
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "presence_penalty": 1.5,
        "frequency_penalty": 2.0,
        "repetition_penalty": 1.3,
        "seed": 3,
        "user": "someone",
        "stop": ["\n\n\n"],
    }
    penalised = post(server, "/v1/completions", {**base, **fields, "logprobs": 1}).json()["choices"][0]
    tokens = post(server, "/tokenize", {"prompt": plain["text"]}).json()["tokens"]
    assert len(set(tokens)) < len(tokens), "greedy output of the random model repeats tokens"
    assert penalised["text"] != plain["text"]  # the penalties changed what greedy decoding picks
    assert len(penalised["logprobs"]["tokens"]) == 40


def test_template_arguments_reach_the_chat_template(server_model, tmp_path):
    """`chat_template_kwargs` and OpenAI's `reasoning_effort` (Responses: `reasoning.effort`)
    are rendered by the template: one that writes them into the prompt, which the model then
    reads as more prompt tokens."""
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if reasoning_effort is defined %} effort {{ reasoning_effort }}{% endif %}"
        "{% if mood is defined %} mood {{ mood }}{% endif %}"
    )
    server = ServerProcess(server_model, "--chat-template", str(template))
    try:
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

        def prompt_tokens(path: str, body: dict) -> int:
            answer = post(server, path, body)
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]["prompt_tokens" if path.endswith("completions") else "input_tokens"]

        plain = prompt_tokens("/v1/chat/completions", chat)
        effort = prompt_tokens("/v1/chat/completions", dict(chat, reasoning_effort="high"))
        mood = prompt_tokens("/v1/chat/completions", dict(chat, chat_template_kwargs={"mood": "calm"}))
        assert effort > plain and mood > plain
        responses = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 1}
        assert prompt_tokens("/v1/responses", dict(responses, reasoning={"effort": "high"})) == effort
        refused = post(server, "/v1/chat/completions", dict(chat, reasoning_effort="extreme"))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    finally:
        server.stop()
