"""The server with `--speculative-config`: answers over a socket match a plain server's, the
drafts show in /metrics, and a bad config stops the server at start with an error naming it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import ROOT, ServerProcess

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def servers(server, server_model):
    speculative = ServerProcess(server_model, "--page-size", "8", "--speculative-config", NGRAM)
    yield server, speculative
    speculative.stop()


def complete(server: ServerProcess, prompt: list[int]) -> dict:
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_speculative_server_answers_as_the_plain_one(servers):
    plain, speculative = servers
    for phrase in ([31, 42, 53], [70, 71, 72, 73]):
        prompt = phrase * 4
        assert complete(speculative, prompt)["text"] == complete(plain, prompt)["text"]
    assert speculative.metric("spec_decode_num_drafts_total") > 0
    assert speculative.metric("spec_decode_num_accepted_tokens_total") > 0
    assert speculative.metric("spec_decode_num_draft_tokens_total") >= speculative.metric(
        "spec_decode_num_accepted_tokens_total"
    )


def test_a_bad_speculative_config_stops_the_server_with_its_reason(server_model):
    command = [
        sys.executable,
        "-m",
        "kestrel",
        "serve",
        str(server_model),
        "--speculative-config",
        '{"method": "eagle"}',
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs 'num_speculative_tokens'" in result.stderr + result.stdout
