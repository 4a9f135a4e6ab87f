"""The physical limits the benchmarks print beside their measurements."""

from __future__ import annotations

import pytest

from kestrel.bench.limits import ExpertStack, ModelCost, compute_limit_tokens_per_s, memory_limit_tokens_per_s


def dense_cost(weight_bytes: int = 1000, kv: int = 10, recurrent: int = 0, experts=()) -> ModelCost:
    return ModelCost(weight_bytes, 0, 0, tuple(experts), kv, recurrent, 0)


def test_memory_limit_counts_weights_per_step_and_each_tokens_context():
    # 2 requests share each of 4 decode steps (1000 weight bytes each); the 8 decoded tokens
    # read a mean context of 10 + 4 / 2 = 12 tokens of 10 bytes: 4000 + 960 bytes at 1000 B/s.
    limit = memory_limit_tokens_per_s(dense_cost(), 2, 10, 4, 8, 1000.0)
    assert limit == pytest.approx(8 / 4.96)


def test_memory_limit_shares_weights_only_up_to_the_batch():
    cost = dense_cost(100, 0)
    alone = memory_limit_tokens_per_s(cost, 4, 0, 2, 1, 100.0)  # 8 steps of one request
    batched = memory_limit_tokens_per_s(cost, 4, 0, 2, 4, 100.0)  # 2 steps of four
    assert batched == pytest.approx(4 * alone)


def test_recurrent_state_is_read_and_written_each_token():
    with_state = memory_limit_tokens_per_s(dense_cost(100, 0, recurrent=50), 1, 0, 1, 1, 100.0)
    assert with_state == pytest.approx(1 / 2.0)  # 100 weight bytes + 2 x 50 state bytes


def test_one_token_reads_only_its_top_k_experts():
    stack = ExpertStack(num_experts=128, top_k=8, bytes_per_expert=1000, params_per_expert=500)
    cost = dense_cost(0, 0, experts=[stack, stack])
    assert cost.weight_bytes(1) == pytest.approx(2 * 8 * 1000)
    # A large batch hits (nearly) every expert; a few tokens hit fewer than top_k each.
    assert cost.weight_bytes(4096) == pytest.approx(2 * 128 * 1000)
    assert 2 * 8 * 1000 < cost.weight_bytes(4) < 4 * 2 * 8 * 1000
    # Compute counts top_k experts per token, whatever the batch.
    assert cost.flops_per_token(0) == 2 * 2 * 8 * 500


def test_compute_limit_counts_the_lm_head_for_sampled_positions_only():
    cost = ModelCost(0, dense_params=10, lm_head_params=100, experts=(), kv_bytes_per_token=0,
                     recurrent_bytes_per_sequence=0, attention_width=0)  # fmt: skip
    # 2 prompts of 3 + 1 tokens: 8 tokens x 20 FLOPs, 2 sampled x 200 FLOPs = 560 FLOPs.
    assert compute_limit_tokens_per_s(cost, 2, 3, 1, 560.0) == pytest.approx(2.0)


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3-moe", "llama-mqa-tied", "gpt-oss", "llama4", "deepseek-v3"])
def test_model_cost_splits_a_loaded_model(checkpoint_dir, family):
    from kestrel import LLM

    parts = LLM(str(checkpoint_dir(family)), page_size=8, max_num_seqs=2).engine.parts
    cost = ModelCost.of(parts)
    model = parts.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expert_total = sum(s.bytes_per_expert * s.num_experts for s in cost.experts)
    table = parts.spec.vocab_size * parts.spec.hidden_size * 4
    untied_table = 0 if parts.spec.tie_word_embeddings else table
    assert cost.dense_weight_bytes + expert_total + untied_table == total
    counts = {"qwen3-next": 2, "qwen3-moe": 1, "llama-mqa-tied": 0, "gpt-oss": 3, "llama4": 2, "deepseek-v3": 2}
    assert len(cost.experts) == counts[family]
    per_expert = {  # float32 gate, up and down (GPT-OSS: and their biases), per expert
        "gpt-oss": (3 * 64 * 128 + 2 * 128 + 64) * 4,
        "llama4": 3 * 64 * 128 * 4,
    }
    tops = {"gpt-oss": 4, "llama4": 1}
    for stack in cost.experts:
        assert stack.bytes_per_expert == per_expert.get(family, 3 * 64 * 32 * 4)
        assert stack.top_k == tops.get(family, 2)
    assert (cost.weight_bytes(1) < total) == bool(cost.experts)
    kv_layers = len(parts.spec.attention_layers())
    kinds = 1 if family == "deepseek-v3" else 2  # a latent pool stores keys alone
    assert cost.kv_bytes_per_token == kinds * kv_layers * parts.kv.spec.num_kv_heads * parts.kv.spec.head_dim * 4
    state = parts.recurrent.spec.bytes_per_slot() if parts.recurrent else 0
    assert cost.recurrent_bytes_per_sequence == state
    assert (state > 0) == (family == "qwen3-next")
    assert cost.flops_per_token(0) < 2 * sum(p.numel() for p in model.parameters())


def test_a_4_bit_model_reads_its_codes_at_one_row_and_its_bfloat16_copy_at_many(checkpoint_dir):
    from kestrel import LLM
    from kestrel.layers.quantized import WIDE_MIN_ROWS, Int4VnniWeight, Int4Weight

    path = str(checkpoint_dir("llama"))
    floats = ModelCost.of(LLM(path, page_size=8, max_num_seqs=2, quantization="none").engine.parts)
    parts = LLM(path, page_size=8, max_num_seqs=2, quantization="int4").engine.parts
    cost = ModelCost.of(parts)
    weights = [getattr(m, "weight", None) for m in parts.runner.model.modules()]
    packed = [w for w in weights if isinstance(w, Int4Weight | Int4VnniWeight)]
    assert packed and cost.num_params == floats.num_params  # the same weights, counted unpacked
    assert cost.dense_params == floats.dense_params
    unpacked_bytes = sum(w.out_features * w.in_features * 4 for w in packed)
    codes_bytes = sum(w.out_features * w.in_features // 2 + w.scales_and_zeros.numel() * 2 for w in packed)
    assert cost.weight_bytes(1) == floats.weight_bytes(1) - unpacked_bytes + codes_bytes
    if packed[0].wide is not None:
        copy_bytes = sum(w.wide.numel() * 2 for w in packed)
        assert cost.weight_bytes(WIDE_MIN_ROWS) == floats.weight_bytes(1) - unpacked_bytes + copy_bytes


def test_an_fp8_model_off_cuda_reads_its_dequantized_reference(checkpoint_dir):
    """Off CUDA a float8 projection multiplies its dequantized copy: that copy, and the
    per-row scales, are what a step reads, not the float8 values; parameters count once."""
    from kestrel import LLM
    from kestrel.layers.quantized import Fp8Weight

    path = str(checkpoint_dir("llama"))
    floats = ModelCost.of(LLM(path, page_size=8, max_num_seqs=2, quantization="none").engine.parts)
    parts = LLM(path, page_size=8, max_num_seqs=2, quantization="fp8").engine.parts
    cost = ModelCost.of(parts)
    packed = [m.weight for m in parts.runner.model.modules() if isinstance(getattr(m, "weight", None), Fp8Weight)]
    assert packed and cost.num_params == floats.num_params
    scales_bytes = sum(w.scales.numel() * 4 for w in packed)
    assert cost.weight_bytes(1) == floats.weight_bytes(1) + scales_bytes
