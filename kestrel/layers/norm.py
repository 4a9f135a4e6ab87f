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
        return ops.rms_norm(x, self.effective_weight, self.eps, residual)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Each head of x [tokens, heads, dim] normalised, then rotated by cos and sin
        [tokens, rotary dim] (a partial rotary dim too): one kernel on CUDA."""
        return ops.head_norm_rotary(x, self.effective_weight, self.eps, cos, sin)

    @property
    def effective_weight(self) -> torch.Tensor:
        """What the normalised values are multiplied by (for kernels that fuse the norm)."""
        return self.weight

    def of_stream(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """norm(hidden + residual) after a decoder layer; norm(hidden) where the layer left no
        residual (it folded its add: hidden is the stream, ResidualBlock.forward)."""
        return self(hidden) if residual is None else self(hidden, residual)[0]

    def row_norm(self) -> ops.RowNorm:
        """This norm, for a linear to apply to its input (`ops.RowNorm`)."""
        return ops.RowNorm(self.effective_weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight is the offset from one (zeros mean identity): Gemma,
    Qwen3-Next."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self._folded: torch.Tensor | None = None

    def after_weights_loaded(self) -> None:
        """1 + weight computed once (the loader calls this): in a forward it took two launches
        per norm, a hundred per decode step of a hybrid model."""
        self._folded = self._fold()

    @property
    def effective_weight(self) -> torch.Tensor:
        return self._folded if self._folded is not None else self._fold()

    def _fold(self) -> torch.Tensor:
        # In float32, as HF computes it: in bf16, 1 + w keeps 8 bits, so an offset of 0.012
        # would move by up to 0.004.
        return self.weight.float() + 1
