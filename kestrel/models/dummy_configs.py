"""Real model shapes for benchmarks with random weights (load_format="dummy"), by name."""

from __future__ import annotations

from typing import Any

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    # Five 1,024-token window layers to each global one; the global rope is linearly scaled.
    "gemma-3-12b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
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
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # A small Qwen3-Next (3 linear-attention layers, 1 full, 8 experts and a shared one): the
    # hybrid model's mechanisms (state snapshots, prefix caching) timed on a CPU.
    "qwen3-next-tiny": dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        mtp_num_hidden_layers=1,
    ),
    # Qwen3-Next-80B-A3B cut to 24 of its 48 layers (the same 3 linear : 1 full pattern), so
    # that bf16 weights fit one 141 GB GPU with room for the KV pool.
    "qwen3-next-80b-a3b-24l": dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        full_attention_interval=4,
        num_experts=512,
        num_experts_per_tok=10,
        norm_topk_prob=True,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000000.0,
        mtp_num_hidden_layers=1,  # the release's multi-token-prediction head
    ),
}

# A quarter of its layers: fits an 80 GB GPU (H100) with a KV pool.
DUMMY_CONFIGS["qwen3-next-80b-a3b-12l"] = dict(DUMMY_CONFIGS["qwen3-next-80b-a3b-24l"], num_hidden_layers=12)


def dummy_hf_config(name: str) -> Any:
    from transformers import AutoConfig

    fields = dict(DUMMY_CONFIGS[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
