"""4-bit weight-only linears for the CPU (layers/quantized.py) against float references."""

from __future__ import annotations

import pytest
import torch

from kestrel.layers.linear import ColumnParallelLinear, Linear, ShardSlice
from kestrel.layers.quantized import (
    COMPUTE_DTYPE,
    GROUP_SIZE,
    WIDE_MIN_ROWS,
    dequantize_int4,
    int4_linear,
    quantize_int4,
    quantize_linears,
)


def q4_1_grid_weight(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose every group of 32 lies on a 16-step grid spanning it (scale * code +
    minimum, both bf16-exact): what a GGUF Q4_1 tensor dequantizes to. Returns it and its codes."""
    groups = columns // GROUP_SIZE
    codes = torch.randint(0, 16, (rows, groups, GROUP_SIZE))
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans the whole grid, as Q4_1's quantizer makes it
    scale = torch.rand(rows, groups, 1).mul(0.02).add(0.001).to(COMPUTE_DTYPE).float()
    minimum = (-8 * scale + torch.randn(rows, groups, 1).mul(0.01)).to(COMPUTE_DTYPE).float()
    return (codes * scale + minimum).reshape(rows, columns), codes.reshape(rows, columns)


def test_a_q4_1_weight_comes_back_to_its_own_grid():
    torch.manual_seed(0)
    weight, _ = q4_1_grid_weight(48, 96)
    packed = quantize_int4(weight)
    # zero = minimum + 8 * scale is rounded to bf16, and the reference reads the weight back
    # through the bf16 kernel: each value within those roundings of its grid point.
    torch.testing.assert_close(dequantize_int4(packed), weight, atol=2e-4, rtol=4e-3)


def test_a_float_weight_is_rounded_to_the_nearest_of_sixteen_levels_per_group():
    torch.manual_seed(1)
    weight = torch.randn(48, 64)
    dequantized = dequantize_int4(quantize_int4(weight))
    groups = weight.reshape(48, 2, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (dequantized - weight).abs().reshape(48, 2, GROUP_SIZE).amax(-1)
    assert torch.all(error <= step * 0.5 + 0.02 * step.abs() + 1e-3)  # half a step, plus bf16 scales
    assert dequantize_int4(quantize_int4(torch.zeros(16, 32))).abs().max() == 0  # a constant group


def test_the_4_bit_matmul_is_the_dequantized_weight():
    torch.manual_seed(2)
    weight, x, bias = torch.randn(80, 160), torch.randn(5, 160), torch.randn(80)
    packed = quantize_int4(weight)
    expected = x.to(COMPUTE_DTYPE).float() @ dequantize_int4(packed).T + bias
    out = int4_linear(x, packed, bias)
    assert out.dtype == torch.float32 and out.shape == (5, 80)
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)


def test_in_features_must_split_into_whole_groups():
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        quantize_int4(torch.randn(16, 40))


def test_only_the_decoder_projections_are_packed():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = ColumnParallelLinear(64, {"q": ShardSlice.whole(64), "k": ShardSlice.whole(32)})
            self.router = Linear(64, 8)  # a MoE router stays as loaded
            self.lm_head = ColumnParallelLinear(64, {None: ShardSlice.whole(100)}, quantizable=False)

    torch.manual_seed(3)
    block = Block()
    for param in block.parameters():
        param.data.normal_()
    x = torch.randn(3, 64)
    assert quantize_linears(block, "int4") == 1
    assert isinstance(block.router.weight, torch.nn.Parameter) and isinstance(block.lm_head.weight, torch.nn.Parameter)
    packed_bytes = sum(p.numel() * p.element_size() for name, p in block.qkv.named_parameters())
    # 4 bits a weight, 1 for its group's bf16 scale and zero, 16 more where a bf16 copy is kept
    bits = 4 + 1 + (16 if block.qkv.weight.wide is not None else 0)
    assert packed_bytes == pytest.approx(96 * 64 * bits / 8)
    expected = x.to(COMPUTE_DTYPE).float() @ dequantize_int4(block.qkv.weight).T
    torch.testing.assert_close(block.qkv(x), expected, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize_linears(block, "int3")


@pytest.mark.skipif(quantize_int4(torch.zeros(16, 32)).wide is None, reason="this CPU has no bfloat16 matmuls")
def test_many_rows_take_the_bfloat16_copy_of_the_same_4_bit_values():
    torch.manual_seed(4)
    weight, x = torch.randn(64, 96), torch.randn(WIDE_MIN_ROWS + 3, 96)
    packed = quantize_int4(weight)
    torch.testing.assert_close(packed.wide.float(), dequantize_int4(packed), atol=0, rtol=0)
    one_at_a_time = torch.cat([int4_linear(row[None], packed) for row in x])
    torch.testing.assert_close(int4_linear(x, packed), one_at_a_time, atol=0.05, rtol=0.02)
