"""Linear layers; merged ones know how to load each stacked shard into its slice."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.core.bindings import WeightBindingError
from kestrel.layers import ops


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output (q,k,v -> qkv; gate,up)."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.output_sizes = dict(output_sizes)
        offsets, start = {}, 0
        for shard_id, size in output_sizes.items():
            offsets[shard_id] = (start, size)
            start += size
        self._offsets = offsets

    def shard_ids(self) -> frozenset[str]:
        return frozenset(self._offsets)

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str) -> None:
        if shard_id not in self._offsets:
            raise WeightBindingError(f"no shard {shard_id!r} in a merged layer of {list(self._offsets)}")
        start, size = self._offsets[shard_id]
        target = param.data.narrow(0, start, size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightBindingError(
                f"shape mismatch for shard {shard_id}: expected {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output.split(list(self.output_sizes.values()), dim=-1))
