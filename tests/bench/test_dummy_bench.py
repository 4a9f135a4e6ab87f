"""The offline benchmarks on a config folder without weights (`--load-format dummy`):
Kestrel and the HF baseline both run random weights of that shape."""

from __future__ import annotations

import json

from kestrel.__main__ import main
from tests.checkpoints import _family_configs, tokenizer


def test_latency_bench_runs_both_engines_on_a_config_folder(tmp_path):
    config = _family_configs(len(tokenizer()), tokenizer().eos_token_id)["qwen3-next"]
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(tmp_path / "model")  # config.json alone: no weights, no tokenizer
    report_path = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(tmp_path / "model"), "--load-format", "dummy"]
    argv += ["--input-len", "8", "--output-len", "6", "--hf-output-len", "3", "--output-json", str(report_path)]
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["hf"]["decode_ms_per_token"] > 0
    assert report["kestrel"]["decode_ms_per_token"] > 0
    # A hybrid MoE step reads its top-k experts, not all of them, and its recurrent state.
    assert 0 < report["weight_bytes_per_step"] < report["model_weight_bytes"]
    assert report["recurrent_state_bytes_per_step"] > 0
