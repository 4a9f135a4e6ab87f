"""The offline benchmarks on a config folder without weights (`--load-format dummy`):
Kestrel and the HF baseline both run random weights of that shape."""

from __future__ import annotations

import json

import torch

from kestrel.__main__ import main
from kestrel.core.state import KVCacheSpec
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


def test_throughput_bench_counts_the_preemptions_of_a_tight_pool(tmp_path):
    """Six sequences of 48 tokens need 36 pages of 8; the pool holds 20, so the engine
    preempts, and the report says how often, beside tokens that all arrived."""
    config = _family_configs(len(tokenizer()), tokenizer().eos_token_id)["qwen3"]
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(tmp_path / "model")
    page = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32, 8)
    report_path = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(tmp_path / "model"), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--dtype", "float32", "--page-size", "8", "--max-model-len", "64", "--no-hf-baseline"]
    argv += ["--kv-cache-memory-gb", str(20 * page.bytes_per_page() / 2**30)]
    argv += ["--num-prompts", "6", "--input-len", "24", "--output-len", "24", "--output-json", str(report_path)]
    assert main(argv) == 0
    lone, batch = json.loads(report_path.read_text())["results"]
    assert lone["preemptions"] == 0 and lone["output_tokens"] == 24
    assert batch["preemptions"] > 0 and batch["output_tokens"] == 6 * 24
