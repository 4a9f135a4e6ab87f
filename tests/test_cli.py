"""The command line, run as a user would: a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kestrel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kestrel", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
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
