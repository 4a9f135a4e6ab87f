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
