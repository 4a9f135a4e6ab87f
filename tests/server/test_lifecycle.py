"""Server lifecycle: overload, SIGTERM drain, and a dead engine core."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_NAME, ServerProcess

LONG = {"model": MODEL_NAME, "prompt": "Go on", "max_tokens": 1000, "ignore_eos": True}


def test_overload_is_503_and_sigterm_aborts_what_is_left(server_model):
    server = ServerProcess(
        server_model,
        "--max-num-seqs",
        "2",
        "--max-queue-len",
        "1",
        "--shutdown-timeout",
        "0.1",
        "--max-model-len",
        "1024",
    )
    core = server.core_pids()
    assert len(core) == 1

    async def scenario() -> tuple[list[str], int]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            running = [asyncio.create_task(client.post("/v1/completions", json=LONG)) for _ in range(3)]
            await asyncio.sleep(0.5)  # three in flight: the limit (2 seats + 1 queued) is reached
            overflow = await client.post("/v1/completions", json={**LONG, "max_tokens": 2})
            server.terminate()
            responses = await asyncio.gather(*running)
            return [r.json()["choices"][0]["finish_reason"] for r in responses], overflow

    try:
        reasons, overflow = asyncio.run(scenario())
    finally:
        server.stop()
    assert overflow.status_code == 503 and "overloaded" in overflow.json()["error"]["message"]
    assert reasons == ["abort"] * 3  # 1000 tokens take longer than the 0.1 s shutdown timeout
    assert server.process.wait(30) == 0
    time.sleep(0.5)
    status = Path(f"/proc/{core[0]}/status")
    assert not status.exists() or "zombie" in status.read_text().lower()


def test_sigterm_lets_short_requests_finish(server_model):
    server = ServerProcess(server_model, "--shutdown-timeout", "20")

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0.2)
            server.terminate()
            return await asyncio.gather(*tasks)

    try:
        responses = asyncio.run(scenario())
    finally:
        server.stop()
    for response in responses:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(30) == 0


def test_dead_engine_core_turns_health_to_503(server_model):
    server = ServerProcess(server_model)
    try:
        [core] = server.core_pids()
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            health = httpx.get(f"{server.base_url}/health")
            if health.status_code == 503:
                break
            time.sleep(0.1)
        assert health.status_code == 503
        assert "engine core process exited unexpectedly" in health.json()["reason"]
        failed = httpx.post(f"{server.base_url}/v1/completions", json={**LONG, "max_tokens": 2}, headers=server.headers)
        assert failed.status_code == 503 and "engine is not running" in failed.json()["error"]["message"]
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return children


def test_tensor_parallel_server_answers_like_one_rank_and_stops_its_workers(server, server_model):
    request = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 12, "temperature": 0}
    expected = httpx.post(f"{server.base_url}/v1/completions", json=request, headers=server.headers)
    split = ServerProcess(server_model, "--tensor-parallel-size", "2")
    try:
        [core] = split.core_pids()
        workers = [pid for pid in _children(core) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1  # rank 1; rank 0 is the core itself
        got = httpx.post(f"{split.base_url}/v1/completions", json=request, headers=split.headers)
        assert got.status_code == 200
        assert got.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
        split.terminate()
        split.process.wait(30)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{workers[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{workers[0]}").exists(), "the tensor-parallel worker outlived the server"
    finally:
        split.stop()
