"""The Triton fused-MoE path against the torch grouped path (SparseMoe), and its sort."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.core.parallel import SINGLE
from kestrel.layers.fused_moe import (
    MatvecLaunch,
    MoeLaunch,
    expected_repeats,
    expert_matvecs,
    fused_moe,
    gemv_route,
    group_by_expert,
    moe_launch,
    route,
    sort_by_expert,
)
from kestrel.layers.moe import SparseMoe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)",
)


def test_sort_groups_rows_by_expert_in_whole_blocks():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    row_ids, block_experts = sort_by_expert(experts, num_experts=4, block_m=4)
    padding = experts.numel()
    blocks = row_ids.view(-1, 4).tolist()
    assert blocks[:3] == [[1, 4, padding, padding], [3, padding, padding, padding], [0, 2, 5, padding]]
    assert block_experts.tolist()[:3] == [0, 1, 2]
    assert all(e == -1 for e in block_experts.tolist()[3:])  # expert 3 got nothing
    assert all(all(r == padding for r in block) for block in blocks[3:])


@pytest.mark.parametrize(
    "tokens, top_k, num_experts, block_m", [(1, 2, 4, 16), (3, 2, 4, 4), (50, 3, 6, 16), (300, 8, 128, 16)]
)
def test_the_grouping_kernels_lay_out_blocks_as_the_sort_does(tokens, top_k, num_experts, block_m):
    generator = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    expected_rows, expected_blocks = sort_by_expert(experts, num_experts, block_m)
    rows, blocks = group_by_expert(experts.to(DEVICE), num_experts, block_m)
    assert blocks.tolist() == expected_blocks.tolist()
    # Inside an expert's run the order is the atomics' (a row may land in any of its
    # blocks), so compare each expert's rows as a set.
    assert expert_rows(rows.cpu(), blocks.cpu(), block_m) == expert_rows(expected_rows, expected_blocks, block_m)


def expert_rows(rows: torch.Tensor, blocks: torch.Tensor, block_m: int) -> dict[int, list[int]]:
    grouped: dict[int, list[int]] = {}
    for expert, block in zip(blocks.tolist(), rows.view(-1, block_m).tolist()):
        grouped.setdefault(expert, []).extend(block)
    return {expert: sorted(rows) for expert, rows in grouped.items()}


@pytest.mark.parametrize("tokens, top_k, renormalize", [(1, 2, True), (5, 2, False), (37, 3, True)])
def test_fused_moe_matches_the_torch_path(tokens, top_k, renormalize):
    torch.manual_seed(0)
    hidden_size, inter, num_experts = 48, 40, 6
    moe = SparseMoe(hidden_size, inter, num_experts, top_k, renormalize).to(DEVICE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    hidden = torch.randn(tokens, hidden_size, device=DEVICE)
    weights, experts = moe.route(hidden)
    expected = moe.grouped(hidden, weights, experts)
    tolerance = dict(atol=2e-3 if DEVICE == "cuda" else 1e-5, rtol=1e-3)
    launches = (None, MoeLaunch(block_m=32, block_n=32, block_k=32), MoeLaunch(64, 128, 64, num_warps=8))
    launches += (MoeLaunch(128, 128, 64, num_warps=8),)  # the prefill entry of the table
    for launch in launches:
        got = fused_moe(hidden, moe.experts.w13.weight, moe.experts.w2.weight, weights, experts, launch)
        torch.testing.assert_close(got, expected, **tolerance)


def test_row_blocks_follow_the_rows_each_expert_gets():
    assert moe_launch(1 * 8, 128).block_m == 16  # a decode token: a row or two per expert
    assert moe_launch(512 * 8, 128).block_m == 32
    assert moe_launch(1024 * 8, 128).block_m == 64
    assert moe_launch(8192 * 8, 128).block_m == 128  # a large prefill: hundreds per expert


@pytest.mark.parametrize(
    "num_experts, top_k, renormalize, shared, gated, scale",
    [
        (6, 2, True, 0, False, 1.0),
        (128, 8, False, 1, True, 1.0),
        (10, 3, True, 1, True, 1.0),
        (16, 6, False, 2, False, 2.5),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_routing_kernel_picks_and_weighs_as_the_torch_path(
    num_experts, top_k, renormalize, shared, gated, scale, dtype
):
    """Routed choices scaled, then `shared` always-on experts: gated by a sigmoid (Qwen3-Next)
    or weighted 1 (DeepSeek's shared experts)."""
    torch.manual_seed(num_experts)
    moe = SparseMoe(16, 8, num_experts, top_k, renormalize)
    logits = torch.randn(37, num_experts).to(dtype)
    shared_logits = torch.randn(37, shared).to(dtype) if gated else None
    expected_weights, expected_experts = moe.route_reference(logits, dtype, shared_logits, shared, scale)
    on_device = shared_logits.to(DEVICE) if gated else None
    weights, experts = route(logits.to(DEVICE), top_k, renormalize, dtype, on_device, shared, scale)
    assert experts.shape == weights.shape == (37, top_k + shared)
    # bf16 logits tie often; either of two tied experts is right, so compare what each chose.
    chosen = logits.gather(1, experts.cpu()[:, :top_k].long())
    assert chosen.tolist() == logits.gather(1, expected_experts[:, :top_k]).tolist()
    assert experts.cpu()[:, top_k:].tolist() == [list(range(num_experts, num_experts + shared))] * 37
    assert experts.cpu()[:, top_k:].tolist() == expected_experts[:, top_k:].tolist()
    if not gated:
        assert weights[:, top_k:].eq(1).all()
    tolerance = 1e-6 * scale if dtype == torch.float32 else 8e-3 * scale
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=tolerance, rtol=0)


def test_the_routing_kernel_breaks_ties_by_the_lower_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    weights, experts = route(logits, 2, True, torch.float32)
    assert experts.tolist() == [[1, 3]]
    assert weights.tolist() == [[0.5, 0.5]]


def test_rows_that_would_rarely_share_an_expert_are_not_grouped():
    assert expected_repeats(8, 128) < 1  # one decode token, top 8 of 128: its own blocks
    assert expected_repeats(16, 128) < 1
    assert expected_repeats(4 * 8, 128) > 1  # four tokens: grouping saves repeated reads
    torch.manual_seed(1)
    moe = SparseMoe(32, 24, 4, 2, True).to(DEVICE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    hidden = torch.randn(3, 32, device=DEVICE)
    experts = torch.tensor([[1, 2], [1, 0], [2, 1]], device=DEVICE)  # experts 1 and 2 chosen thrice
    weights = torch.rand(3, 2, device=DEVICE)
    expected = moe.grouped(hidden, weights, experts)
    got = fused_moe(hidden, moe.experts.w13.weight, moe.experts.w2.weight, weights, experts)
    torch.testing.assert_close(got, expected, atol=2e-3 if DEVICE == "cuda" else 1e-5, rtol=1e-3)


@pytest.mark.parametrize(
    "launches",
    [
        None,
        (MatvecLaunch(4, 16), MatvecLaunch(1, 8)),
        (MatvecLaunch(8, 64), MatvecLaunch(2, 32)),
    ],
)
def test_expert_matvecs_sum_each_tokens_experts_as_the_torch_path(launches):
    """Two tokens, three choices each (the last one always-on, as a stacked shared expert),
    odd widths, and column blocks that take several loads per row."""
    torch.manual_seed(2)
    moe = SparseMoe(40, 36, 5, 2, True, num_stacked=6).to(DEVICE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    hidden = torch.randn(2, 40, device=DEVICE)
    experts = torch.tensor([[3, 0, 5], [1, 3, 5]], device=DEVICE)
    weights = torch.rand(2, 3, device=DEVICE)
    expected = moe.grouped(hidden, weights, experts)
    got = expert_matvecs(hidden, moe.experts.w13.weight, moe.experts.w2.weight, weights, experts, launches)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_pipeline_stages_shrink_to_fit_shared_memory():
    """Hopper's 227 KB: float32 tiles of the gate-and-up matmul (two weight tiles a stage) need
    fewer stages than the bf16 table gives; bf16 keeps its stages."""
    from kestrel.layers.fused_moe import stages_that_fit

    launch = MoeLaunch(block_m=16, block_n=128, block_k=128)  # 3 stages
    assert stages_that_fit(launch, 2, 2, 232448) == 3  # bf16: 2 x 69,632 bytes buffered
    assert stages_that_fit(launch, 4, 2, 232448) == 2  # float32: 2 x 139,264 would overflow
    assert stages_that_fit(launch, 4, 1, 232448) == 3


@pytest.mark.parametrize("tokens", [1, 37])
def test_float8_experts_match_the_dequantized_torch_path(tokens):
    """`quantization="fp8"` on a MoE layer: each expert's rows in e4m3 with a scale per row;
    the matvecs (one token) and the grouped matmuls (37) widen them in registers and scale
    each output, as the torch path multiplies the dequantized weights."""
    torch.manual_seed(4)
    moe = SparseMoe(48, 40, 6, 2, True).to(DEVICE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    float_w2 = moe.experts.w2.weight.detach().clone()
    moe.quantize("fp8")
    assert moe.experts.w13.weight.dtype == torch.float8_e4m3fn and moe.experts.w2.scales.shape == (6, 48)
    dequantized = moe.experts.w2.expert(3, torch.float32)
    assert (dequantized - float_w2[3]).abs().max() <= float_w2[3].abs().max() / 16  # e4m3: 3 mantissa bits
    hidden = torch.randn(tokens, 48, device=DEVICE)
    weights, experts = moe.route(hidden)
    expected = moe.grouped(hidden, weights, experts)
    w13, w2 = moe.experts.w13, moe.experts.w2
    got = fused_moe(hidden, w13.weight, w2.weight, weights, experts, scales=(w13.scales, w2.scales))
    torch.testing.assert_close(got, expected, atol=2e-3 if DEVICE == "cuda" else 1e-5, rtol=1e-3)


def reference_experts(hidden, w13, w2, weights, experts, activation, b13=None, b2=None, scale_input=False):
    """Each token's sum over its chosen experts, one at a time, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for weight, expert in zip(weights[token].tolist(), experts[token].tolist()):
            x = hidden[token].double() * (weight if scale_input else 1.0)
            gate_up = w13[expert].double() @ x + (0 if b13 is None else b13[expert].double())
            down = w2[expert].double() @ activation(gate_up) + (0 if b2 is None else b2[expert].double())
            out[token] += down * (1.0 if scale_input else weight)
    return out.float()


@pytest.mark.parametrize("tokens", [1, 37])  # one-row matvecs, and grouped matmuls
def test_gpt_oss_experts_biases_and_clamped_swiglu_match_the_reference(tokens):
    from kestrel.layers.fused_moe import CLAMPED_SWIGLU, ExpertForm
    from kestrel.models.gpt_oss import swiglu

    torch.manual_seed(0)
    hidden_size, inter, num_experts, top_k = 48, 40, 8, 4
    # Large enough that the clamps at 7 act on some products.
    w13, b13 = torch.randn(num_experts, 2 * inter, hidden_size), torch.randn(num_experts, 2 * inter) * 3
    w2, b2 = torch.randn(num_experts, hidden_size, inter) * 0.2, torch.randn(num_experts, hidden_size)
    hidden = torch.randn(tokens, hidden_size)
    logits = torch.randn(tokens, num_experts)
    top, experts = logits.topk(top_k, dim=-1)
    weights = top.softmax(dim=-1)
    expected = reference_experts(hidden, w13, w2, weights, experts, swiglu, b13, b2)
    assert (hidden @ w13[0].T + b13[0]).abs().max() > 7
    form = ExpertForm(CLAMPED_SWIGLU, b13.to(DEVICE), b2.to(DEVICE))
    args = (w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), experts.to(DEVICE))
    got = fused_moe(hidden.to(DEVICE), *args, form=form)
    tolerance = dict(atol=2e-3 if DEVICE == "cuda" else 1e-4, rtol=1e-3)
    torch.testing.assert_close(got.cpu(), expected, **tolerance)


@pytest.mark.parametrize("tokens", [1, 37])
def test_llama4_routing_weights_scale_the_experts_input(tokens):
    from kestrel.layers.fused_moe import ExpertForm

    torch.manual_seed(1)
    hidden_size, inter, num_experts = 48, 40, 4
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden_size) * 0.3, torch.randn(num_experts, hidden_size, inter) * 0.3
    hidden = torch.randn(tokens, hidden_size)
    top, experts = torch.randn(tokens, num_experts).topk(1, dim=-1)
    scores = torch.sigmoid(top)

    def silu_and_mul(gate_up):
        gate, up = gate_up.chunk(2)
        return torch.nn.functional.silu(gate) * up

    expected = reference_experts(hidden, w13, w2, scores, experts, silu_and_mul, scale_input=True)
    args = (w13.to(DEVICE), w2.to(DEVICE), scores.to(DEVICE), experts.to(DEVICE))
    got = fused_moe(hidden.to(DEVICE), *args, form=ExpertForm(weights_scale_input=True))
    tolerance = dict(atol=2e-3 if DEVICE == "cuda" else 1e-4, rtol=1e-3)
    torch.testing.assert_close(got.cpu(), expected, **tolerance)


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused routing kernel runs on CUDA tensors")
def test_deepseek_v2_greedy_routing_on_cuda_matches_the_torch_path():
    from transformers import DeepseekV2Config

    from kestrel.models.deepseek import DeepseekMoe, DeepseekV2Recipe, route

    config = DeepseekV2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=6,
        moe_intermediate_size=32, n_shared_experts=2, routed_scaling_factor=1.5, topk_method="greedy",
    )  # fmt: skip
    spec = DeepseekV2Recipe().spec(config)
    moe = DeepseekMoe(spec, SINGLE).cuda()
    torch.manual_seed(0)
    moe.gate.weight.data.normal_(0, 0.5)
    hidden = torch.randn(9, 64, device="cuda")
    weights, experts = moe.route(hidden)
    assert experts[:, 6:].tolist() == [[16, 17]] * 9 and weights[:, 6:].eq(1).all()  # the shared experts
    weights, experts = weights[:, :6], experts[:, :6]
    logits = hidden.float() @ moe.gate.weight.float().T
    expected_weights, expected_experts = route(logits, None, 6, False, spec.routing)
    order, expected_order = experts.argsort(dim=-1), expected_experts.argsort(dim=-1)
    assert torch.equal(experts.long().gather(1, order), expected_experts.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))


def test_gpt_oss_routing_is_the_fused_kernels_renormalised_softmax():
    """GPT-OSS takes a softmax over its top k logits; the routing kernel's softmax over all of
    them, renormalised over the k chosen, is the same weights (what its CUDA path runs)."""
    torch.manual_seed(3)
    logits = torch.randn(23, 32) * 3
    top, expected_experts = logits.topk(4, dim=-1)
    expected = top.softmax(dim=-1)
    weights, experts = route(logits.to(DEVICE), 4, True, torch.float32)
    assert experts.cpu().long().tolist() == expected_experts.tolist()
    torch.testing.assert_close(weights.cpu(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "num_experts, top_k, renormalize, gated_shared, bias",
    [(128, 8, True, 0, False), (12, 3, False, 1, False), (32, 4, True, 0, True)],
)
@pytest.mark.parametrize("launch", [(1, 64, 1), (4, 32, 2), (8, 128, 4)])
def test_the_router_matvec_that_routes_picks_as_a_matvec_then_the_routing_kernel(
    num_experts, top_k, renormalize, gated_shared, bias, launch
):
    """gemv_route: every program's logits reach the last one to arrive, whichever it is, and
    the arrival count is back to zero for the next call (asserted by calling it again; on a
    GPU, where programs race, at a real router's width and many times)."""
    import triton

    from kestrel.layers.gemv import gemv

    torch.manual_seed(num_experts + top_k)
    dtype = torch.bfloat16
    hidden, calls = (2048, 50) if DEVICE == "cuda" else (96, 2)
    x = torch.randn(1, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(num_experts + gated_shared, hidden, device=DEVICE).to(dtype) / hidden**0.5
    router_bias = torch.randn(num_experts, device=DEVICE).to(dtype) if bias else None
    block_n, block_k, warps = launch
    config = triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps)
    logits = gemv(x, weight, router_bias, config)  # the two launches it replaces, same sums
    shared = logits[:, num_experts:] if gated_shared else None
    expected = route(logits[:, :num_experts], top_k, renormalize, dtype, shared, gated_shared)
    assert expected[1].unique().numel() == top_k + gated_shared
    for _ in range(calls):
        got = gemv_route(x, weight, router_bias, num_experts, top_k, renormalize, gated_shared, config)
        assert got[1].tolist() == expected[1].tolist()
        torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)


def test_the_router_matvec_that_routes_refuses_a_weight_of_the_wrong_rows():
    with pytest.raises(ValueError, match="8 \\+ 1 rows"):
        gemv_route(torch.zeros(1, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE), None, 8, 2, True, 1)


def test_the_one_row_moe_folds_the_input_norm_and_the_residual_add():
    """The router's matvec that routes and the expert matvecs, given the norm and the
    residual, against the norm's own kernel, the same two launches, then the add."""
    from kestrel.layers import fused
    from kestrel.layers.ops import RowNorm

    torch.manual_seed(8)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    hidden_size = 2048 if DEVICE == "cuda" else 96
    moe = SparseMoe(hidden_size, 64, 16, 4, True).to(DEVICE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    moe = moe.to(dtype)
    x = torch.randn(1, hidden_size, device=DEVICE).to(dtype)
    residual = torch.randn(1, hidden_size, device=DEVICE).to(dtype)
    norm = RowNorm((1 + 0.3 * torch.randn(hidden_size, device=DEVICE)).to(dtype), 1e-6)
    normed = fused.rms_norm(x, norm.weight, norm.eps)
    router = moe.gate.weight
    expected_weights, expected_experts = gemv_route(normed, router, None, 16, 4, True)
    weights, experts = gemv_route(x, router, None, 16, 4, True, norm=norm)
    assert experts.tolist() == expected_experts.tolist()
    torch.testing.assert_close(weights, expected_weights, atol=1e-2 if DEVICE == "cuda" else 1e-6, rtol=0)
    w13, w2 = moe.experts.w13.weight, moe.experts.w2.weight
    separate = expert_matvecs(normed, w13, w2, weights.flatten(), experts)
    expected = (separate.float() + residual.float()).to(dtype)
    got = fused_moe(x, w13, w2, weights, experts, norm=norm, residual=residual)
    half = dtype != torch.float32
    torch.testing.assert_close(got, expected, atol=5e-2 if half else 1e-5, rtol=2e-2 if half else 1e-5)
    assert torch.equal(fused_moe(normed, w13, w2, weights, experts, residual=residual), expected)
