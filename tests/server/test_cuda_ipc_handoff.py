"""Prefill/decode disaggregation on one GPU with the state lent through CUDA IPC
(`--kv-buffer-device cuda`): real instances and the router as processes, spoken to over HTTP.
GPU only; the same deployment over TCP is tests/server/test_disaggregation.py."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from tests.server.conftest import API_KEY, MODEL_NAME, RouterProcess, ServerProcess, stop_together

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")

GPU = (
    "--device",
    "cuda",
    "--dtype",
    "float32",
    "--kv-cache-memory-gb",
    "0.25",
    "--page-size",
    "8",
    "--max-model-len",
    "512",
)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def complete(base_url: str, prompt, **extra) -> tuple[str, list[float]]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    body |= {"ignore_eos": True, **extra}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def wait_for(server: ServerProcess, metric: str, value: float, seconds: float = 10) -> float:
    deadline = time.monotonic() + seconds
    while (seen := server.metric(metric)) != value and time.monotonic() < deadline:
        time.sleep(0.2)
    return seen


@pytest.mark.parametrize("family", ["qwen3", "qwen3-next"])
def test_state_lent_on_the_gpu_gives_one_instances_answers(checkpoint_dir, family):
    model = checkpoint_dir(family)
    prefill = ServerProcess(model, *GPU, "--kv-role", "prefill", "--kv-buffer-device", "cuda")
    decode = ServerProcess(model, *GPU, "--kv-role", "decode")
    router = RouterProcess([prefill.base_url], [decode.base_url])
    try:
        prompts = ["The quick brown fox", list(range(3, 200)), [42]]
        for prompt in prompts:
            # One instance's answer: a request without kv_transfer_params runs whole where it lands.
            expected_text, expected_logprobs = complete(prefill.base_url, prompt)
            text, logprobs = complete(router.base_url, prompt)
            assert text == expected_text
            assert logprobs == pytest.approx(expected_logprobs, abs=1e-3)
        # Only where the state lies crossed HTTP, and every lent buffer came back.
        assert 0 < decode.metric("kv_transfer_received_bytes_total") < 4096 * len(prompts)
        assert wait_for(prefill, "kv_transfer_device_bytes", 0) == 0
        assert prefill.metric("kv_transfer_lent") == 0 and prefill.metric("kv_transfer_pending") == 0
        assert prefill.metric("kv_cache_used_pages") == 0 and decode.metric("kv_cache_used_pages") == 0
    finally:
        stop_together(router, prefill, decode)


def test_state_fetched_and_never_released_is_freed_when_it_expires(checkpoint_dir):
    """A decode instance that fetched the description and died: the prefill instance's GPU
    buffer goes when the transfer times out."""
    prefill = ServerProcess(
        checkpoint_dir("qwen3"),
        *GPU,
        "--kv-role",
        "prefill",
        "--kv-buffer-device",
        "cuda",
        "--kv-transfer-timeout",
        "2",
    )
    try:
        body = {"model": MODEL_NAME, "prompt": list(range(3, 100)), "max_tokens": 4}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        handoff = httpx.post(f"{prefill.base_url}/v1/completions", json=body, headers=HEADERS, timeout=60).json()
        transfer_id = handoff["kv_transfer_params"]["transfer_id"]
        fetched = httpx.get(f"{prefill.base_url}/v1/kv_transfer/{transfer_id}", headers=HEADERS)
        assert fetched.status_code == 200 and len(fetched.content) < 4096
        assert wait_for(prefill, "kv_transfer_device_bytes", -1, seconds=1) > 0  # held on the GPU
        assert prefill.metric("kv_transfer_lent") == 1
        time.sleep(2.5)
        # Any transfer request runs the expiry; an unknown id then answers 404.
        assert httpx.get(f"{prefill.base_url}/v1/kv_transfer/{'0' * 32}", headers=HEADERS).status_code == 404
        assert prefill.metric("kv_transfer_lent") == 0 and prefill.metric("kv_transfer_expired_total") == 1
        assert wait_for(prefill, "kv_transfer_device_bytes", 0) == 0
        assert prefill.metric("kv_cache_used_pages") == 0
    finally:
        prefill.stop()
