"""TensorParallel: this process's place in a tensor-parallel group, and its collectives.

Layers receive it when they are built and use it for two things only: which slice of each
checkpoint tensor they hold, and the collective that completes their output. With one rank
every collective is a no-op, so single-device models pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` units (heads, rows); they must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {self.size}")
        return total // self.size

    def head_slice(self, num_heads: int, what: str) -> tuple[int, int]:
        """(first head, head count) this rank holds. With fewer heads than ranks, each head is
        replicated on size // num_heads consecutive ranks (KV heads under GQA)."""
        if num_heads >= self.size:
            count = self.split(num_heads, what)
            return self.rank * count, count
        if self.size % num_heads:
            raise ValueError(f"tensor_parallel_size {self.size} is not a multiple of {what} ({num_heads})")
        return self.rank // (self.size // num_heads), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results (row-parallel layers)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the tokens only rank 0 samples)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min_across_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (so that every rank sizes its pool alike)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' column blocks [rows, cols] into [rows, size * cols]."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
