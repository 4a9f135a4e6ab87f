"""Online FP8 (`quantization="fp8"`, layers/quantized.py and layers/fp8_matmul.py): e4m3
weights with a scale per row, activations per token; the CPU's reference path, the one-row
float8 matvec (Triton's interpreter on the CPU), and on a GPU the float8 matmul against it."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kestrel.layers.fp8_matmul import _round_to_e4m3
from kestrel.layers.linear import ColumnParallelLinear, ShardSlice
from kestrel.layers.quantized import (
    FP8_FEW_ROWS,
    Fp8Weight,
    quantize_fp8,
    quantize_linears,
    round_rows_through_fp8,
)

E4M3_STEP = 2**-3  # e4m3 keeps 3 mantissa bits: a value moves by at most half of 1/8 of itself
CUDA = torch.cuda.is_available()
TRITON = CUDA or os.environ.get("TRITON_INTERPRET") == "1"


def test_each_row_is_scaled_so_its_largest_value_is_e4m3s_largest():
    torch.manual_seed(0)
    weight = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]  # rows of very different sizes
    packed = quantize_fp8(weight)
    assert packed.values.dtype == torch.float8_e4m3fn and packed.scales.shape == (32,)
    assert torch.equal(packed.values.float().abs().amax(dim=1), torch.full((32,), 448.0))
    error = (packed.reference - weight).abs()
    # Each value moves by at most half a step of its own binade (or of the smallest normal).
    assert (error <= weight.abs() * E4M3_STEP / 2 + packed.scales[:, None] * 2**-10).all()


def test_activations_round_through_e4m3_per_row():
    x = torch.tensor([[1.0, -3.0, 447.0 / 448.0 * 3.0], [0.0, 0.0, 0.0]])
    rounded = round_rows_through_fp8(x)
    assert torch.equal(rounded[1], x[1])  # a zero row stays zero (its scale is clamped, not 0)
    assert rounded[0, 1].item() == -3.0  # the row's largest magnitude maps to 448 exactly
    torch.testing.assert_close(rounded[0], x[0], atol=0, rtol=E4M3_STEP / 2)


def test_the_reference_path_is_the_rounded_activations_times_the_dequantized_weight():
    torch.manual_seed(1)
    weight, x = torch.randn(48, 64), torch.randn(FP8_FEW_ROWS + 4, 64)
    packed = quantize_fp8(weight)
    dequantized = packed.values.float() * packed.scales[:, None]
    torch.testing.assert_close(packed.linear(x), round_rows_through_fp8(x) @ dequantized.t(), atol=1e-5, rtol=1e-5)
    # A step of a few rows multiplies its activations as they are (the GPU's few-rows kernel).
    few = x[:3]
    torch.testing.assert_close(packed.linear(few), few @ dequantized.t(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(round_rows_through_fp8(few) @ dequantized.t(), few @ dequantized.t(), atol=1e-5)
    # And the quantization's own error against float32, for scale: a few percent of an output.
    assert (packed.linear(x) - x @ weight.t()).abs().max() < 0.1 * (x @ weight.t()).abs().max()


def test_quantize_linears_packs_the_projections_in_float8():
    layer = ColumnParallelLinear(64, {"q": ShardSlice.whole(32), "k": ShardSlice.whole(16)})
    layer.quantizable = True
    layer.weight.data.normal_()
    original = layer.weight.detach().clone()
    model = torch.nn.Sequential(layer)
    assert quantize_linears(model, "fp8") == 1
    assert isinstance(layer.weight, Fp8Weight)
    x = torch.randn(2, 64)
    exact = x @ original.t()
    assert (layer(x) - exact).abs().max() < 0.1 * exact.abs().max()
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())  # counted as weight bytes


@pytest.mark.skipif(not TRITON, reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
def test_the_one_row_matvec_reads_float8_rows_times_their_scales():
    from kestrel.layers.gemv import gemv

    torch.manual_seed(2)
    device = "cuda" if CUDA else "cpu"
    packed = quantize_fp8(torch.randn(40, 300))
    values, scales = packed.values.to(device), packed.scales.to(device)
    x = torch.randn(1, 300, device=device, dtype=torch.bfloat16 if CUDA else torch.float32)
    config = triton.Config({"BLOCK_N": 2, "BLOCK_K": 128}, num_warps=4)
    got = gemv(x, values, None, config, scale=scales)
    expected = x.float() @ (values.float() * scales[:, None]).t()
    torch.testing.assert_close(got.float(), expected, atol=2e-2 if CUDA else 1e-5, rtol=1e-2 if CUDA else 1e-5)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize(("rows", "splits"), [(2, 1), (5, 1), (FP8_FEW_ROWS, 1), (5, 2), (FP8_FEW_ROWS, 4)])
def test_a_few_rows_read_each_float8_row_once_times_its_scale(rows, splits):
    from kestrel.layers.fp8_matmul import FewRowsLaunch, few_rows_linear

    torch.manual_seed(4)
    device = "cuda" if CUDA else "cpu"
    packed = quantize_fp8(torch.randn(40, 300))  # ragged against the launch's blocks below
    values, scales = packed.values.to(device), packed.scales.to(device)
    x = torch.randn(rows, 300, device=device, dtype=torch.bfloat16 if CUDA else torch.float32)
    # 300 columns in blocks of 64: 5 steps; 2 splits take 3 + 2, and 4 become 3 of 2 + 2 + 1.
    got = few_rows_linear(x, values, scales, FewRowsLaunch(block_n=16, block_k=64, num_stages=2, splits=splits))
    expected = x.float() @ (values.float() * scales[:, None]).t()
    torch.testing.assert_close(got.float(), expected, atol=2e-2 if CUDA else 1e-5, rtol=1e-2 if CUDA else 1e-5)


def test_a_few_rows_split_the_reduction_only_where_too_few_column_blocks_fill_the_gpu():
    from kestrel.layers.fp8_matmul import FEW_ROWS_PROGRAMS, MAX_SPLITS, reduction_splits

    # Llama-3-8B in blocks of 32 outputs: o and down (4,096), qkv (6,144), gate/up (28,672).
    assert [reduction_splits(n // 32) for n in (4096, 6144, 28672)] == [4, 2, 1]
    assert reduction_splits(1) == MAX_SPLITS
    for blocks in range(1, 2 * FEW_ROWS_PROGRAMS):
        splits = reduction_splits(blocks)
        assert blocks * splits <= max(FEW_ROWS_PROGRAMS, blocks)


@pytest.mark.skipif(
    not CUDA, reason="float8 matmuls need CUDA (Triton's interpreter drops the exponent carry of e4m3 rounding)"
)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_float8_matmul_matches_the_reference_path(rows):
    torch.manual_seed(3)
    weight, x = torch.randn(256, 512), torch.randn(rows, 512).bfloat16().float()
    dequantized = quantize_fp8(weight).reference
    # Many rows: activations rounded through e4m3 per row, as the CPU emulates; a few rows (the
    # matvec, the few-rows kernel: pure weight reads): bf16 activations as they are.
    expected = (x if rows <= FP8_FEW_ROWS else round_rows_through_fp8(x)) @ dequantized.t()
    got = quantize_fp8(weight.cuda()).linear(x.cuda().bfloat16()).float().cpu()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.02)  # bf16 output, accumulation order


def test_a_moe_model_in_fp8_keeps_its_experts_in_float8_and_its_router_as_loaded(checkpoint_dir):
    from kestrel import LLM, SamplingParams
    from kestrel.layers.moe import SparseMoe

    path = str(checkpoint_dir("qwen3-moe"))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 77]}]
    reference = LLM(path, dtype="float32", kv_cache_memory_gb=0.05)
    floats = reference.generate(prompts, greedy, use_tqdm=False)[0]
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.05, quantization="fp8")
    layers = [m for m in llm.engine.parts.runner.model.modules() if isinstance(m, SparseMoe)]
    assert layers and all(m.experts.w13.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert all(m.gate.weight.dtype == torch.float32 for m in layers)
    # Teacher-forced: both score the float model's answer (a random model's near ties flip).
    answer = prompts[0]["prompt_token_ids"] + floats.outputs[0].token_ids
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    rows = [
        run.generate([{"prompt_token_ids": answer}], score, use_tqdm=False)[0].prompt_logprobs
        for run in (llm, reference)
    ]
    differences = [abs(got[t].logprob - want[t].logprob) for t, got, want in zip(answer[5:], rows[0][5:], rows[1][5:])]
    # Measured: largest 0.25 nats over 8 tokens (the dense tiny Llama in fp8: 0.19); a wrong
    # scale or layout moves logprobs by whole nats.
    assert max(differences) < 0.5 and sum(differences) / len(differences) < 0.25


@triton.jit
def _rounded(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, _round_to_e4m3(x), mask=offsets < n)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_activations_round_to_e4m3_as_torch_rounds():
    """The kernel's own rounding (the GPU's conversion rounds through float16 first): every
    value, normal and subnormal, positive and negative, to torch's e4m3 neighbour."""
    torch.manual_seed(5)
    device = "cuda" if CUDA else "cpu"
    x = (torch.randn(8192) * torch.exp2(torch.randint(-12, 9, (8192,)).float())).clamp(-448, 448)
    ties = torch.tensor([1.0625, 1.1875, -1.0625, 2**-9 * 1.5, 2**-9 * 2.5, 240.0, 464.0 - 16])  # halfway points
    x = torch.cat([x, ties]).to(device)
    out = torch.empty_like(x)
    _rounded[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out.cpu(), x.cpu().to(torch.float8_e4m3fn).float())
