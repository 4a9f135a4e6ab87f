"""The CUDA 4-bit kernels (W4A16) against the float weight their codes mean, under Triton's
interpreter in CI and compiled on a GPU: one-row matvecs and tiled matmuls, with and without
bias, uneven output widths, several groups."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.layers.int4_matmul import int4_linear_cuda
from kestrel.layers.quantized import dequantize_int4_cuda, quantize_int4_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)",
)


def test_packing_keeps_every_code_and_the_grid_error_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(40, 256)
    packed = quantize_int4_cuda(weight)
    assert packed.codes.shape == (40, 32) and packed.codes.dtype == torch.int32
    assert packed.scales.shape == packed.zeros.shape == (40, 2)
    dequantized = dequantize_int4_cuda(packed)
    steps = packed.scales.float().repeat_interleave(128, dim=1)
    # Round to nearest on a grid whose ends are each group's min and max (scales in bf16).
    assert ((dequantized - weight).abs() <= 0.5 * steps * 1.02).all()


@pytest.mark.parametrize(
    "rows, in_features",
    # The matvec over three groups in one block, and over 20 groups in three blocks, the last
    # partial; a small and a tall matmul tile.
    [(1, 384), (1, 2560), (5, 384), (40, 384)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernels_multiply_by_the_dequantized_weight(rows, in_features, with_bias):
    torch.manual_seed(rows)
    out_features = 72  # an output width no block divides
    weight = quantize_int4_cuda(torch.randn(out_features, in_features).to(DEVICE))
    x = torch.randn(rows, in_features, device=DEVICE)
    bias = torch.randn(out_features, device=DEVICE) if with_bias else None
    got = int4_linear_cuda(x, weight.codes, weight.scales, weight.zeros, weight.group_size, bias)
    expected = x.double() @ dequantize_int4_cuda(weight).double().T
    if bias is not None:
        expected += bias.double()
    torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA format is chosen by the weights' device")
def test_a_cuda_model_quantized_to_int4_packs_its_projections_only():
    from kestrel.layers.linear import ColumnParallelLinear, Linear, ShardSlice
    from kestrel.layers.quantized import Int4CudaWeight, quantize_linears

    model = torch.nn.Module()
    model.proj = ColumnParallelLinear(256, {None: ShardSlice.whole(64)})
    model.router = Linear(256, 8)  # not quantizable
    model.odd = ColumnParallelLinear(200, {None: ShardSlice.whole(64)})  # not whole groups of 128
    for param in model.parameters():
        param.data.normal_()
    model.to(DEVICE)
    assert quantize_linears(model, "int4") == 1
    assert isinstance(model.proj.weight, Int4CudaWeight) and isinstance(model.odd.weight, torch.nn.Parameter)
    x = torch.randn(3, 256, device=DEVICE)
    torch.testing.assert_close(model.proj(x), x @ dequantize_int4_cuda(model.proj.weight).T, atol=1e-3, rtol=1e-3)
