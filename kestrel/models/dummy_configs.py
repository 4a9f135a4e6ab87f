"""Real model shapes for benchmarks with random weights (load_format="dummy"), by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    # LongRoPE on three quarters of each head (its 48 factors here a placeholder ramp: the
    # weights are random anyway), tied embeddings, a 200k vocabulary.
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 48,
            "long_factor": [1.0 + i / 2 for i in range(48)],
            "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75,
        },
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        pad_token_id=199999,
        eos_token_id=199999,
        bos_token_id=199999,
    ),
    # gpt-oss-20b's shape (bf16 experts: its published checkpoint stores them as MXFP4):
    # 128-token window layers and full ones in turn, 4 of 32 experts, YaRN to 131,072 tokens.
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        attention_bias=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        eos_token_id=200002,
        pad_token_id=199999,
    ),
    # DeepSeek-V2-Lite's shape (15.7B, 2.4B active): multi-head latent attention (a 512-dim
    # latent + 64 rotary dims per token and layer), a dense first layer, then 6 of 64 experts
    # by softmax and 2 shared experts; YaRN to 163,840 tokens with DeepSeek's mscale.
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        topk_method="greedy",
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=100000,
        eos_token_id=100001,
    ),
    # Llama 4 Scout's text shape (17B active, 109B total): 16 experts, top-1, a shared expert,
    # chunks of 8,192 tokens, every fourth layer full attention without rope.
    "llama-4-scout": dict(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        vocab_size=202048,
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=8192,
        max_position_embeddings=10485760,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=[200001, 200007, 200008],
        pad_token_id=200018,
        bos_token_id=200000,
    ),
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
# Half its layers: its throughput runs fit an 80 GB GPU (H100), whose pool the whole model leaves too small.
DUMMY_CONFIGS["qwen3-30b-a3b-24l"] = dict(DUMMY_CONFIGS["qwen3-30b-a3b"], num_hidden_layers=24)


def dummy_hf_config(name: str) -> Any:
    from transformers import AutoConfig

    fields = dict(DUMMY_CONFIGS[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def write_numbered_tokenizer(name: str, directory: Path) -> Path:
    """A tokenizer for a built-in shape, which has none: token `<i>` for every id of its
    vocabulary, so a server on random weights streams text whose pieces map one to one onto
    tokens (serving benchmarks count them). Written to `directory`, returned."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{index}>": index for index in range(DUMMY_CONFIGS[name]["vocab_size"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern=">", behavior="merged_with_previous")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<0>").save_pretrained(directory)
    return directory
