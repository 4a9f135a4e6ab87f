"""Linear layers. Sharded ones (column- and row-parallel) know which slice of each
checkpoint tensor the rank holds and load it there; a column-parallel one may stack several tensors (q, k, v)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kestrel.core.parallel import TensorParallel
from kestrel.core.weight_bindings import WeightBindingError
from kestrel.layers import ops
from kestrel.layers.quantized import (
    INT4,
    PackedWeight,
    quantize_fp8,
    quantize_int4,
    quantize_int4_cuda,
    register_packed,
)


class Linear(nn.Module):
    # Whether a one-row input takes the Triton matvec: set by `choose_matvec_kernels` at
    # start-up, before any graph is captured, from a measurement on this weight's shape.
    use_gemv = False
    # Whether `quantize_linears` may pack this weight (the decoder's projections, not a router).
    quantizable = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | PackedWeight = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def quantize(self, method: str) -> None:
        """Pack the loaded weight ("int4" or "fp8"); every op that takes `self.weight`
        dispatches on it. The packed tensors stay registered as parameters, so what counts
        weight bytes sees them."""
        if method == INT4:
            packed = quantize_int4_cuda(self.weight) if ops.runs_kernels(self.weight) else quantize_int4(self.weight)
        else:
            packed = quantize_fp8(self.weight)
        del self.weight
        register_packed(self, "weight", packed)
        self.weight = packed

    @property
    def matvec_weight(self) -> torch.Tensor:
        return self.weight

    def folds(self, x: torch.Tensor) -> bool:
        """Whether `x` takes the one-row matvec here, which applies an input norm and adds a
        residual inside its own launch (`ops.RowNorm`)."""
        return ops.matvec_operands(x, self.weight, self.use_gemv) is not None

    def forward(self, x: torch.Tensor, norm: ops.RowNorm | None = None) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.use_gemv, norm=norm)


@dataclass(frozen=True)
class ShardSlice:
    """The rows [start, start + size) of a checkpoint tensor of `total` rows that this rank
    holds. Rows past `total` (padding of an uneven split) are zero."""

    start: int
    size: int
    total: int

    @classmethod
    def whole(cls, size: int) -> ShardSlice:
        return cls(0, size, size)

    def take(self, tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if tensor.dim() <= dim or tensor.shape[dim] != self.total:
            raise WeightBindingError(
                f"shape mismatch for {what}: expected {self.total} along dim {dim}, got {tuple(tensor.shape)}"
            )
        return tensor.narrow(dim, self.start, max(0, min(self.size, self.total - self.start)))


def copy_into(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """Copy `source` into the leading part of `target` along dim 0 (the rest is padding)."""
    if tuple(target.shape[1:]) != tuple(source.shape[1:]) or source.shape[0] > target.shape[0]:
        expected, got = tuple(target.shape), tuple(source.shape)
        raise WeightBindingError(f"shape mismatch for {what}: expected {expected}, got {got}")
    target.zero_()
    target[: source.shape[0]].copy_(source)


class ColumnParallelLinear(Linear):
    """Output rows split across ranks; one or several checkpoint tensors stack into it (q, k,
    v -> qkv; gate, up). Each shard knows which of the checkpoint's rows this rank holds."""

    quantizable = True

    def __init__(
        self, in_features: int, shards: dict[str | None, ShardSlice], bias: bool = False, quantizable: bool = True
    ) -> None:
        super().__init__(in_features, sum(shard.size for shard in shards.values()), bias)
        self.quantizable = quantizable
        self.shards = dict(shards)
        self.output_sizes = {name: shard.size for name, shard in shards.items()}
        self._offsets, start = {}, 0
        for name, shard in shards.items():
            self._offsets[name] = start
            start += shard.size

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset(self.shards)

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        if shard_id not in self.shards:
            raise WeightBindingError(f"no shard {shard_id!r} in a merged layer of {list(self.shards)}")
        shard = self.shards[shard_id]
        target = param.data.narrow(0, self._offsets[shard_id], shard.size)
        copy_into(target, shard.take(tensor, 0, f"shard {shard_id}"), f"shard {shard_id}")

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output.split(list(self.output_sizes.values()), dim=-1))


class RowParallelLinear(Linear):
    """Input columns split across ranks: each rank's partial product is summed across ranks,
    then the (replicated) bias added once."""

    quantizable = True

    def __init__(self, in_features: int, out_features: int, parallel: TensorParallel, bias: bool = False) -> None:
        part = parallel.split(in_features, "the input width of a row-parallel layer")
        super().__init__(part, out_features, bias)
        self.parallel = parallel
        self.columns = ShardSlice(parallel.rank * part, part, in_features)

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        if param is self.weight:
            tensor = self.columns.take(tensor, 1, "weight columns")
        if tuple(param.shape) != tuple(tensor.shape):
            raise WeightBindingError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(tensor.shape)}")
        param.data.copy_(tensor)

    def folds(self, x: torch.Tensor) -> bool:
        # The residual joins after the ranks' sum: inside the matvec only on one rank.
        return self.parallel.size == 1 and super().folds(x)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T summed over ranks (+ bias) (+ `residual`)."""
        if residual is not None and self.folds(x):
            return ops.linear(x, self.weight, self.bias, self.use_gemv, residual=residual)
        out = self.parallel.all_reduce(ops.linear(x, self.weight, use_gemv=self.use_gemv))
        out = out if self.bias is None else out + self.bias
        return out if residual is None else out + residual


class FusedColumnLinear(ColumnParallelLinear):
    """A column-parallel layer whose checkpoint holds every part in one tensor, each whole,
    one after another (Phi-3's qkv_proj and gate_up_proj): the tensor is cut at the parts'
    full sizes and each part loaded as its own shard (this rank's rows of it)."""

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        if shard_id is not None:
            raise WeightBindingError(f"a fused projection takes one checkpoint tensor, not shard {shard_id!r}")
        totals = [shard.total for shard in self.shards.values()]
        if tensor.shape[0] != sum(totals):
            raise WeightBindingError(
                f"shape mismatch for a fused projection of parts {list(self.shards)}: expected {sum(totals)} rows, "
                f"got {tuple(tensor.shape)}"
            )
        for name, part in zip(self.shards, tensor.split(totals)):
            super().load_shard(param, part, name)
