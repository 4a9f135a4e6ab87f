"""Prefill/decode disaggregation: a prefill instance, a decode instance and the router, as
processes, spoken to with the openai client; their answers against one instance's."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from kestrel.core import cuda_ipc
from tests.server.conftest import API_KEY, MODEL_NAME, RouterProcess, ServerProcess, stop_together

COMMON = ("--page-size", "8", "--max-model-len", "512")


@pytest.fixture(scope="module")
def deployment(server_model):
    """One instance alone, and a prefill instance + a decode instance behind the router."""
    single = ServerProcess(server_model, *COMMON)
    prefill = ServerProcess(server_model, *COMMON, "--kv-role", "prefill", "--kv-transfer-timeout", "10")
    decode = ServerProcess(server_model, *COMMON, "--kv-role", "decode")
    router = RouterProcess([prefill.base_url], [decode.base_url])
    yield single, prefill, decode, router
    stop_together(router, single, prefill, decode)


def direct(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)


def completion_tokens(client: openai.OpenAI, prompt, **options) -> tuple[str, list]:
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
        **options,
    )
    choice = response.choices[0]
    return choice.text, choice.logprobs.token_logprobs


def test_disaggregated_answers_equal_one_instance(deployment):
    single, prefill, decode, router = deployment
    prompts = ["The quick brown fox", "A" * 300, [5, 9, 2, 44, 7, 13] * 20, [42]]  # the last: one token
    for prompt in prompts:
        expected_text, expected_logprobs = completion_tokens(direct(single), prompt)
        text, logprobs = completion_tokens(router.client(), prompt)
        assert text == expected_text
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = dict(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    expected = direct(single).chat.completions.create(**chat).choices[0].message.content
    assert router.client().chat.completions.create(**chat).choices[0].message.content == expected
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in router.client().chat.completions.create(**chat, stream=True)
        if chunk.choices
    )
    assert streamed == expected
    # Every page back on both sides; every prefilled state fetched once.
    assert prefill.metric("kv_transfer_pending") == 0 and prefill.metric("kv_transfer_sent_bytes_total") > 0
    assert decode.metric("kv_transfer_received_bytes_total") == prefill.metric("kv_transfer_sent_bytes_total")
    assert prefill.metric("kv_cache_used_pages") == 0 and decode.metric("kv_cache_used_pages") == 0


def test_a_client_that_leaves_mid_stream_leaves_no_pages(deployment):
    _, prefill, decode, router = deployment
    stream = router.client().completions.create(
        model=MODEL_NAME, prompt="Count with me", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while decode.metric("kv_cache_used_pages") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.metric("kv_cache_used_pages") == 0 and prefill.metric("kv_cache_used_pages") == 0
    assert prefill.metric("kv_transfer_pending") == 0


def test_handoff_fields_are_checked(deployment):
    single, prefill, decode, _ = deployment
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for server, params, message in [
        (single, {"do_remote_decode": True}, "--kv-role prefill"),
        (prefill, {"do_remote_prefill": True, "remote_host": "x", "remote_port": 1, "num_tokens": 3}, "--kv-role"),
        (prefill, {"something": 1}, "do_remote_decode or do_remote_prefill"),
        (decode, {"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "remote_port"),
    ]:
        response = httpx.post(
            f"{server.base_url}/v1/completions", json={**body, "kv_transfer_params": params}, headers=headers
        )
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    # A transfer id the prefill instance never gave: the decode instance says where it failed.
    bogus = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.port,
        "transfer_id": "0" * 32,
        "num_tokens": 2,
    }
    response = httpx.post(
        f"{decode.base_url}/v1/completions", json={**body, "kv_transfer_params": bogus}, headers=headers
    )
    assert response.status_code == 502 and "no prefilled state" in response.json()["error"]["message"]
    # State of the wrong length for this prompt: refused by the engine, by name.
    handoff = httpx.post(
        f"{prefill.base_url}/v1/completions",
        json={**body, "prompt": "Hello there, a longer prompt", "kv_transfer_params": {"do_remote_decode": True}},
        headers=headers,
    ).json()["kv_transfer_params"]
    mismatched = {**bogus, **handoff}
    response = httpx.post(
        f"{decode.base_url}/v1/completions", json={**body, "kv_transfer_params": mismatched}, headers=headers
    )
    assert response.status_code == 400 and "tokenized it differently" in response.json()["error"]["message"]
    assert decode.metric("kv_cache_used_pages") == 0


def test_failed_handoffs_give_their_seats_back(deployment, server_model):
    """A decode request whose state cannot be fetched fails with a 502 and holds no seat: with
    room for two requests, three failed handoffs leave the instance serving, and it stops at
    once on SIGTERM (a held seat kept its drain waiting until it was killed)."""
    _, prefill, _, _ = deployment
    decode = ServerProcess(server_model, *COMMON, "--kv-role", "decode", "--max-num-seqs", "1", "--max-queue-len", "1")
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2}
        unknown = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": prefill.port}
        unknown |= {"transfer_id": "1" * 32, "num_tokens": 2}
        for _ in range(3):
            failed = httpx.post(
                f"{decode.base_url}/v1/completions", json={**body, "kv_transfer_params": unknown}, headers=headers
            )
            assert failed.status_code == 502
        assert httpx.post(f"{decode.base_url}/v1/completions", json=body, headers=headers).status_code == 200
        start = time.monotonic()
        decode.stop()
        assert time.monotonic() - start < 15
    finally:
        decode.stop()


def test_unfetched_state_expires(server_model):
    prefill = ServerProcess(server_model, *COMMON, "--kv-role", "prefill", "--kv-transfer-timeout", "0.5")
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {
            "model": MODEL_NAME,
            "prompt": "Hello there",
            "max_tokens": 4,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        handoff = httpx.post(f"{prefill.base_url}/v1/completions", json=body, headers=headers).json()
        transfer_id = handoff["kv_transfer_params"]["transfer_id"]
        assert prefill.metric("kv_transfer_pending") == 1
        time.sleep(1.0)
        fetched = httpx.get(f"{prefill.base_url}/v1/kv_transfer/{transfer_id}", headers=headers)
        assert fetched.status_code == 404 and "expired" in fetched.json()["error"]["message"]
        assert prefill.metric("kv_transfer_pending") == 0 and prefill.metric("kv_transfer_expired_total") == 1
        assert prefill.metric("kv_cache_used_pages") == 0
    finally:
        prefill.stop()


def test_a_dead_instance_fails_requests_clearly(server_model):
    prefill = ServerProcess(server_model, *COMMON, "--kv-role", "prefill")
    decode = ServerProcess(server_model, *COMMON, "--kv-role", "decode")
    router = RouterProcess([prefill.base_url], [decode.base_url])
    try:
        client = router.client(max_retries=0, timeout=30)
        stream = client.completions.create(
            model=MODEL_NAME, prompt="Go on", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        for pid in [decode.process.pid, *decode.core_pids()]:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="decode instance"):
            for _ in chunks:
                pass
        for pid in [prefill.process.pid, *prefill.core_pids()]:
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failure:
            client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
        assert failure.value.status_code == 502 and "prefill instance" in str(failure.value)
        assert time.monotonic() - start < 15
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


# Every kind of state beside full-attention pages (tests/server's own model, qwen3): recurrent
# state (a hybrid), a latent KV pool (MLA), sliding-window layers in a group of their own.
# Every family goes through the same handoff format engine to engine: tests/engine/test_handoff.py.
@pytest.mark.parametrize("family", ["qwen3-next", "deepseek-v3", "gemma3"])
def test_each_kind_of_state_is_handed_over(checkpoint_dir, family):
    model = checkpoint_dir(family)
    prefill = ServerProcess(model, *COMMON, "--kv-role", "prefill")
    decode = ServerProcess(model, *COMMON, "--kv-role", "decode")
    router = RouterProcess([prefill.base_url], [decode.base_url])
    try:
        for prompt in (list(range(3, 60)), "a short one"):
            # One instance's answer: a request without kv_transfer_params runs whole where it lands.
            expected = completion_tokens(direct(prefill), prompt)[0]
            assert completion_tokens(router.client(), prompt)[0] == expected
        assert prefill.metric("kv_transfer_sent_bytes_total") > 0  # the router's requests were handed over
        assert decode.metric("kv_cache_used_pages") == 0 and prefill.metric("kv_transfer_pending") == 0
    finally:
        stop_together(router, prefill, decode)


class _LendingInstance(BaseHTTPRequestHandler):
    """Stands in for a prefill instance that lends its state on a GPU: answers every fetch
    with a CUDA IPC description and records the decode instance's release."""

    released: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"kind": cuda_ipc.KIND, "request_id": "x", "num_tokens": 2}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self) -> None:  # noqa: N802
        type(self).released.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_state_lent_on_a_gpu_is_refused_clearly_by_a_cpu_instance_and_released(deployment):
    _, _, decode, _ = deployment
    lender = ThreadingHTTPServer(("127.0.0.1", 0), _LendingInstance)
    threading.Thread(target=lender.serve_forever, daemon=True).start()
    try:
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": lender.server_port}
        params |= {"transfer_id": "a" * 32, "num_tokens": 2}
        body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2, "kv_transfer_params": params}
        response = httpx.post(f"{decode.base_url}/v1/completions", json=body, headers=decode.headers, timeout=30)
        assert response.status_code == 400 and "--kv-buffer-device cpu" in response.json()["error"]["message"]
        deadline = time.monotonic() + 5
        while not _LendingInstance.released and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _LendingInstance.released == [f"/v1/kv_transfer/{'a' * 32}"]
        assert decode.metric("kv_cache_used_pages") == 0
    finally:
        lender.shutdown()
