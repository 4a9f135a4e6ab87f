"""The CPU op choices agree with plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.layers import ops


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows, bias):
    torch.manual_seed(0)
    x, weight = torch.randn(rows, 96), torch.randn(200, 96)
    b = torch.randn(200) if bias else None
    torch.testing.assert_close(ops.linear(x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    # A strided view of the weight (a tied embedding's rows, a slice of experts) works too.
    torch.testing.assert_close(ops.linear(x, weight[::2]), F.linear(x, weight[::2]), atol=1e-4, rtol=1e-5)


def test_linear_in_bfloat16_stays_close():
    torch.manual_seed(0)
    x, weight = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.linear(x, weight).float(), F.linear(x, weight).float(), atol=0.1, rtol=0.02)


def test_an_offset_norm_keeps_its_weight_in_float32_as_gemma_does():
    from kestrel.layers.norm import OffsetRMSNorm

    torch.manual_seed(5)
    norm = OffsetRMSNorm(256, 1e-6)
    norm.weight.data = (torch.randn(256) * 0.02).to(torch.bfloat16)  # offsets bf16 cannot add to 1
    x = torch.randn(3, 256).to(torch.bfloat16)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (normed * (1.0 + norm.weight.float())).to(torch.bfloat16)  # HF's Gemma3RMSNorm
    got = norm(x)
    assert got.dtype == torch.bfloat16
    # One bf16 rounding of the normed values apart at most; with 1 + w rounded to bf16 the
    # error would reach the offsets' own size.
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2**-7)
