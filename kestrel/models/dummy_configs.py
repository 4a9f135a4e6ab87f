"""Real model shapes for benchmarks with random weights (load_format="dummy"), by name."""

from __future__ import annotations

from typing import Any

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-60m": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=64000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
}


def dummy_hf_config(name: str) -> Any:
    from transformers import AutoConfig

    fields = dict(DUMMY_CONFIGS[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
