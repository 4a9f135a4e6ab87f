"""Server lifecycle: overload, SIGTERM drain, and a dead engine core."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_NAME, ServerProcess

LONG = {"model": MODEL_NAME, "prompt": "Go on", "max_tokens": 1000, "ignore_eos": True}


def test_overload_is_429_and_sigterm_aborts_what_is_left(server_model):
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
    assert overflow.status_code == 429 and "overloaded" in overflow.json()["error"]["message"]
    assert overflow.headers["retry-after"] == "1"
    assert reasons == ["abort"] * 3  # 1000 tokens take longer than the 0.1 s shutdown timeout
    assert server.process.wait(30) == 0
    time.sleep(0.5)
    status = Path(f"/proc/{core[0]}/status")
    assert not status.exists() or "zombie" in status.read_text().lower()


async def running(client: httpx.AsyncClient, count: int, timeout: float = 30) -> None:
    """Wait until the server reports `count` requests running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith("kestrel:num_requests_running{") and float(line.rsplit(" ", 1)[1]) >= count:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{count} requests never ran at once")


def test_sigterm_lets_short_requests_finish(server_model):
    server = ServerProcess(server_model, "--shutdown-timeout", "20")

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            await running(client, 2)  # both admitted before the signal, however busy the machine is
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


def test_a_dead_engine_core_fails_its_requests_and_stops_the_server(server_model):
    server = ServerProcess(server_model)
    try:
        in_flight: list[httpx.Response] = []
        request = threading.Thread(
            target=lambda: in_flight.append(
                httpx.post(f"{server.base_url}/v1/completions", json=LONG, headers=server.headers, timeout=60)
            )
        )
        request.start()
        time.sleep(0.5)
        [core] = server.core_pids()
        os.kill(core, signal.SIGKILL)
        request.join()
        assert in_flight[0].status_code == 503
        assert "engine core process exited unexpectedly" in in_flight[0].json()["error"]["message"]
        # The server exits non-zero within seconds, so that a supervisor restarts it.
        assert server.process.wait(timeout=10) == 1
        assert "engine core process exited unexpectedly" in server.output()
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
        workers = [
            pid for pid in _children(core) if b"kestrel.distributed.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
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


def test_a_burst_cannot_pass_the_queue_limit(server_model):
    server = ServerProcess(server_model, "--max-num-seqs", "2", "--max-queue-len", "4")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            body = {**LONG, "stream": True}
            requests = [client.build_request("POST", "/v1/completions", json=body) for _ in range(20)]
            responses = await asyncio.gather(*(client.send(r, stream=True) for r in requests))
            for response in responses:
                await response.aclose()
            return responses

    try:
        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * 6 + [429] * 14  # 2 seats + 4 queued
        assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
    finally:
        server.stop()


def test_a_client_that_leaves_counts_as_an_abort(server):
    before = _abort_count(server)
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={**LONG, "stream": True}, headers=server.headers
    ) as response:
        next(response.iter_lines())  # the stream started; then the client hangs up
    deadline = time.monotonic() + 10
    while _abort_count(server) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _abort_count(server) == before + 1


def _abort_count(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("kestrel:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
