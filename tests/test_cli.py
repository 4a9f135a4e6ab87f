"""The command line, run as a user would: a real subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def kestrel(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kestrel", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **(env or {})),
    )


def test_make_demo_model_then_generate(tmp_path):
    made = kestrel("make-demo-model", str(tmp_path / "demo"))
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "demo" / "model.safetensors").exists()
    assert (tmp_path / "demo" / "tokenizer.json").exists()
    run = kestrel(
        "generate", "--model", str(tmp_path / "demo"), "--prompt", "Hello", "--prompt", "Bye", "--max-tokens", "5"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("(5 tokens, length)") == 2
    assert "prompt: 'Hello'" in run.stdout and "prompt: 'Bye'" in run.stdout


def test_generate_with_compiled_decode_steps_matches_eager(checkpoint_dir):
    """-O3 (vLLM's shorthand) compiles the decode steps of one row: the same greedy text."""
    model = str(checkpoint_dir("llama"))
    args = ("generate", "--model", model, "--prompt", "Hello there", "--max-tokens", "12", "--temperature", "0")
    eager, compiled = kestrel(*args), kestrel(*args, "-O3")
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr
    assert "compiling decode steps of [1] rows: done" in compiled.stderr
    assert compiled.stdout == eager.stdout and "(12 tokens, length)" in eager.stdout


def test_bad_model_path_is_a_clear_error_not_a_traceback(tmp_path):
    run = kestrel("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert run.returncode == 2
    assert "is not a directory" in run.stderr and "Traceback" not in run.stderr


def test_serve_reports_a_bad_engine_option_clearly(tmp_path):
    made = kestrel("make-demo-model", str(tmp_path / "demo"))
    assert made.returncode == 0, made.stderr
    run = kestrel("serve", str(tmp_path / "demo"), "--port", "0", "--max-model-len", "999999")
    assert run.returncode == 2
    assert "max_model_len 999999 exceeds the model's max_position_embeddings 2048" in run.stderr
    assert "Traceback" not in run.stderr


def test_serve_says_what_a_folder_lacks(tmp_path, checkpoint_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = kestrel("serve", str(empty), "--port", "0")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "has no config.json and no .gguf file" in run.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint_dir("qwen3") / name, bare / name)
    run = kestrel("serve", str(bare), "--port", "0")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "has no tokenizer files" in run.stderr and "--tokenizer" in run.stderr


def fake_hub_cache(cache: Path, model_id: str, source: Path) -> None:
    """A Hugging Face cache holding `model_id` at `main`, as `snapshot_download` leaves it."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo / "snapshots" / commit)


def test_a_hugging_face_id_resolves_through_the_local_cache(tmp_path, checkpoint_dir):
    fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3", checkpoint_dir("qwen3"))
    offline = dict(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    run = kestrel("generate", "--model", "tiny-org/tiny-qwen3", "--prompt", "Hello", "--max-tokens", "3", env=offline)
    assert run.returncode == 0, run.stderr
    assert "(3 tokens, length)" in run.stdout
    missing = kestrel("generate", "--model", "tiny-org/absent", "--prompt", "Hello", env=offline)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "'tiny-org/absent' is not in the local Hugging Face cache" in missing.stderr


def test_a_copied_vllm_serve_line_starts_and_its_flags_work(checkpoint_dir):
    from tests.server.conftest import ServerProcess

    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    server = ServerProcess(
        checkpoint_dir("qwen3"),
        *("--served-model-name", "first-name", "second-name"),
        *("--trust-remote-code", "--enable-chunked-prefill", "--generation-config", "auto", "--block-size", "8"),
        *("--max-logprobs", "5", "--chat-template", template, "--disable-log-requests", "--dtype", "float"),
        name_flag=False,
    )
    try:
        url, headers = server.base_url, server.headers
        body = {"model": "second-name", "prompt": "Hi", "max_tokens": 2, "logprobs": 5}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=headers).status_code == 200
        too_many = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 6}, headers=headers)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
        tokens = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "x"}]}, headers=headers)
        detok = httpx.post(f"{url}/detokenize", json={"tokens": tokens.json()["tokens"]}, headers=headers)
        assert detok.json()["prompt"] == "<<x>>"
        assert httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == "first-name"
    finally:
        server.stop()
    quantized = kestrel("serve", str(checkpoint_dir("qwen3")), "--port", "0", "--quantization", "marlin")
    assert quantized.returncode == 2 and "quantization='marlin' is not supported yet" in quantized.stderr


def test_a_built_in_shape_serves_with_a_numbered_tokenizer():
    """`kestrel serve SHAPE --load-format dummy` (serving benchmarks on real sizes): one `<id>`
    piece per token, in and out."""
    from tests.server.conftest import ServerProcess

    server = ServerProcess(
        "qwen3-next-tiny", "--load-format", "dummy", "--max-model-len", "256", api_key=None, name_flag=False
    )
    try:
        body = {"model": "qwen3-next-tiny", "prompt": "<5><6><7>", "max_tokens": 5, "ignore_eos": True}
        answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["prompt_tokens"] == 3 and answer["usage"]["completion_tokens"] == 5
        assert re.fullmatch(r"(<\d+>){5}", answer["choices"][0]["text"])
    finally:
        server.stop()


def test_kv_buffer_device_belongs_to_a_prefill_instance(checkpoint_dir):
    run = kestrel("serve", str(checkpoint_dir("qwen3")), "--port", "0", "--kv-buffer-device", "cuda")
    assert run.returncode == 2
    assert "--kv-buffer-device" in run.stderr and "--kv-role prefill" in run.stderr
    assert "Traceback" not in run.stderr
