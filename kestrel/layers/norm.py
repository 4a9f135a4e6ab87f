"""RMSNorm, computed in float32 as Hugging Face does, cast back before the weight."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.layers import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one pass."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
