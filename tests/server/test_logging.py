"""What the server logs: one line per finished request (never the prompt text), periodic
engine stats, and neither when asked not to."""

from __future__ import annotations

import re
import time

import httpx

from tests.server.conftest import ServerProcess

SECRET_PROMPT = "the secret launch code is swordfish"


def complete(server: ServerProcess, max_tokens: int) -> dict:
    body = {"prompt": SECRET_PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(server: ServerProcess, pattern: str, timeout: float = 15) -> re.Match | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if match := re.search(pattern, server.output()):
            return match
        time.sleep(0.2)
    return None


def test_requests_and_engine_stats_are_logged(server_model):
    server = ServerProcess(server_model, env={"KESTREL_LOG_STATS_INTERVAL": "0.5"})
    try:
        answer = complete(server, max_tokens=7)
        prompt_tokens = answer["usage"]["prompt_tokens"]
        line = wait_for(
            server, r"request (\S+) finished: (\d+) prompt tokens, (\d+) output tokens, finish_reason (\w+)"
        )
        assert line is not None, server.output()
        assert answer["id"].removeprefix("cmpl-") in line.group(1)
        assert (int(line.group(2)), int(line.group(3)), line.group(4)) == (prompt_tokens, 7, "length")
        assert wait_for(server, r"engine: \d+ running, \d+ waiting, KV cache [\d.]+% used, prompt [\d.]+ tokens/s")
        assert SECRET_PROMPT not in server.output()
    finally:
        server.stop()


def test_disabled_logs_stay_quiet(server_model):
    server = ServerProcess(
        server_model, "--disable-log-requests", "--disable-log-stats", env={"KESTREL_LOG_STATS_INTERVAL": "0.2"}
    )
    try:
        complete(server, max_tokens=3)
        time.sleep(1.0)
        assert "finished:" not in server.output() and "engine:" not in server.output()
    finally:
        server.stop()
