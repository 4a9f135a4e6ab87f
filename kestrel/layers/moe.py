"""Mixture of experts: top-k routing and a grouped expert computation.

Expert weights are stacked at load time (gate and up -> w13 [experts, 2 * inter, hidden];
down -> w2 [experts, hidden, inter]). Tokens are sorted by expert and each expert runs one
matmul over all of its tokens: the Python loop is over experts, never over tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import PackedMapping, WeightBindingError
from kestrel.layers import ops
from kestrel.layers.linear import Linear, ShardSlice, copy_into
from kestrel.layers.quantized import E4M3_MAX, FP8_MIN_SCALE


@dataclass(frozen=True)
class RoutedExperts:
    """What a mixture of experts reads per routed expert, for counting the bytes a step really
    reads (bench/limits.py): each tensor is stacked by expert along dim 0, the routed experts
    first (an always-on expert stacked after them is read every step)."""

    num_experts: int  # the router picks from these
    top_k: int
    tensors: tuple[torch.Tensor, ...]


class StackedExpertWeight(nn.Module):
    """One weight per expert, stacked; each checkpoint tensor is shard "<expert>:<part>".

    Under tensor parallelism each part keeps this rank's slice of its rows (gate, up) or of
    its columns (down)."""

    def __init__(
        self, num_experts: int, parts: dict[str, ShardSlice], columns: ShardSlice, combined_from: int | None = None
    ) -> None:
        """The experts from index `combined_from` on (always-on experts) come as one checkpoint
        tensor per part, `n` experts wide (DeepSeek's `shared_experts`): shard "shared:<part>",
        split evenly between them along its intermediate dim."""
        super().__init__()
        rows = sum(part.size for part in parts.values())
        self.weight = nn.Parameter(torch.empty(num_experts, rows, columns.size), requires_grad=False)
        self.columns = columns
        self._rows: dict[str, tuple[int, ShardSlice]] = {}
        start = 0
        for part, rows_slice in parts.items():
            self._rows[part] = (start, rows_slice)
            start += rows_slice.size
        self._first_shared = num_experts if combined_from is None else combined_from
        self._shards = frozenset(f"{e}:{part}" for e in range(self._first_shared) for part in parts)
        if self._first_shared < num_experts:
            self._shards |= {f"shared:{part}" for part in parts}
        self.scales: torch.Tensor | None = None  # [experts, rows] float32 once the weight is float8

    def quantize_fp8(self) -> None:
        """Each expert's rows to float8 e4m3 with a float32 scale per row (the largest
        magnitude maps to 448): half the bytes a decode step reads from its experts."""
        rows = self.weight.detach().float()
        scales = (rows.abs().amax(dim=2) / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
        values = (rows / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        self.weight = nn.Parameter(values, requires_grad=False)
        self.scales = scales

    def expert(self, index: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One expert's weight in `dtype` (dequantized where it is float8); for a tensor of
        indices, theirs stacked."""
        weight = self.weight[index]
        if self.scales is None:
            return weight
        return (weight.float() * self.scales[index][..., None]).to(dtype)

    def shard_ids(self) -> frozenset[str]:
        return self._shards

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str) -> None:
        if shard_id not in self._shards:
            raise WeightBindingError(f"no expert shard {shard_id!r}")
        expert, part = shard_id.split(":")
        if expert == "shared":
            self._load_always_on(param, tensor, part)
            return
        self._load_expert(param, tensor, int(expert), part, f"expert shard {shard_id}")

    def _load_expert(self, param: torch.Tensor, tensor: torch.Tensor, expert: int, part: str, what: str) -> None:
        start, rows = self._rows[part]
        piece = self.columns.take(rows.take(tensor, 0, what), 1, what)
        copy_into(param.data[expert].narrow(0, start, rows.size), piece, what)

    def _load_always_on(self, param: torch.Tensor, tensor: torch.Tensor, part: str) -> None:
        """One checkpoint tensor for every always-on expert: its rows (gate, up) or its columns
        (down) are the experts' intermediate dims one after another."""
        count = param.shape[0] - self._first_shared
        rows = self._rows[part][1]
        dim = 0 if tensor.shape[0] == count * rows.total else 1
        if tensor.shape[dim] != count * (rows.total if dim == 0 else self.columns.total):
            raise WeightBindingError(
                f"shape mismatch for shared expert part {part!r}: {tuple(tensor.shape)} does not split "
                f"into {count} experts of {tuple(param.shape[1:])}"
            )
        for index, piece in enumerate(tensor.chunk(count, dim)):
            expert = self._first_shared + index
            self._load_expert(param, piece, expert, part, f"shared expert {index} ({part}), stacked as {expert}")


class SparseMoe(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        parallel: TensorParallel = SINGLE,
        num_stacked: int | None = None,
        always_on_combined: bool = False,
    ) -> None:
        """`num_stacked` experts are stacked (default: the `num_experts` the router picks
        from); any past those are always-on experts that a subclass routes every token to,
        loaded one by one or, with `always_on_combined`, from one wider tensor per part."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_stacked = num_stacked or num_experts
        self.parallel = parallel
        self.gate = Linear(hidden_size, num_experts)  # the router is replicated
        part = parallel.split(intermediate_size, "moe_intermediate_size")
        inner = ShardSlice(parallel.rank * part, part, intermediate_size)
        self.experts = nn.Module()
        stacked = self.num_stacked
        combined = num_experts if always_on_combined else None
        gate_up = {"gate": inner, "up": inner}
        self.experts.w13 = StackedExpertWeight(stacked, gate_up, ShardSlice.whole(hidden_size), combined)
        self.experts.w2 = StackedExpertWeight(stacked, {"down": ShardSlice.whole(hidden_size)}, inner, combined)

    @property
    def num_always_on(self) -> int:
        """Experts stacked after the routed ones, which every token takes."""
        return self.num_stacked - self.num_experts

    def route(
        self, hidden: torch.Tensor, shared_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token and their weights (softmax in float32, as HF does); with
        `shared_logits` [tokens, always-on experts], the always-on experts after them, weighted
        by their sigmoid. One kernel on CUDA; at one row, that kernel is the router's matvec."""
        if shared_logits is None and ops.takes_gemv(hidden, self.gate.use_gemv):
            return self.route_in_matvec(hidden, self.gate.weight, self.gate.bias)
        return self.pick(self.gate(hidden), hidden.dtype, shared_logits)

    def route_folded(self, hidden: torch.Tensor, norm: ops.RowNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` of norm(hidden) where `folds`: in the router's matvec, which applies the norm."""
        return self.route_in_matvec(hidden, self.gate.weight, self.gate.bias, norm=norm)

    def route_in_matvec(
        self,
        hidden: torch.Tensor,
        router: torch.Tensor,
        bias: torch.Tensor | None = None,
        gated_shared: int = 0,
        norm: ops.RowNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` of one row (or of norm(row)) in one launch (`gemv_route`): the router's
        matvec, whose last program routes. `router` may carry `gated_shared` rows of
        always-on experts' gates."""
        from kestrel.layers.fused_moe import gemv_route

        args = (self.num_experts, self.top_k, self.renormalize, gated_shared)
        return gemv_route(hidden, router, bias, *args, norm=norm)

    def pick(
        self,
        logits: torch.Tensor,
        dtype: torch.dtype,
        shared_logits: torch.Tensor | None = None,
        always_on: bool = False,
        routed_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` from the router's logits [tokens, experts] (any row stride); the routed
        weights times `routed_scale`. The always-on experts follow where `shared_logits` are
        given (weighted by their sigmoid) or `always_on` is asked for (weighted 1)."""
        num_shared = self.num_always_on if always_on or shared_logits is not None else 0
        if ops.runs_kernels(logits):
            from kestrel.layers.fused_moe import route

            return route(logits, self.top_k, self.renormalize, dtype, shared_logits, num_shared, routed_scale)
        return self.route_reference(logits, dtype, shared_logits, num_shared, routed_scale)

    def route_reference(
        self,
        logits: torch.Tensor,
        dtype: torch.dtype,
        shared_logits: torch.Tensor | None = None,
        num_shared: int | None = None,
        routed_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = (weights * routed_scale).to(dtype)
        if num_shared is None:
            num_shared = 0 if shared_logits is None else shared_logits.shape[1]
        return append_always_on(weights, experts, self.num_experts, num_shared, shared_logits)

    def folds(self, hidden: torch.Tensor) -> bool:
        """Whether a one-row `hidden` takes the router's matvec and the expert matvecs, which
        fold an input norm and a residual add (`forward`'s `norm` and `residual`): no
        always-on experts, one rank (the residual joins after the ranks' sum)."""
        return self.num_always_on == 0 and self.parallel.size == 1 and self.gate.folds(hidden)

    def forward(
        self, hidden: torch.Tensor, norm: ops.RowNorm | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts' mix of norm(hidden) (with `norm`; else of hidden as given), plus
        `residual`: inside the router's and the experts' matvecs where they fold them."""
        if norm is None and residual is None:
            return self.mix_experts(hidden, *self.route(hidden))
        return self.forward_folded(hidden, norm, residual)

    def forward_folded(
        self, hidden: torch.Tensor, norm: ops.RowNorm | None, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """`forward` with a norm or a residual: inside the router's matvec and the expert
        matvecs where they fold them (`route_folded`); else in launches of their own."""
        if not self.folds(hidden):
            normed = hidden if norm is None else ops.rms_norm(hidden, norm.weight, norm.eps)
            out = self(normed)
            return out if residual is None else out + residual
        from kestrel.layers.fused_moe import fused_moe

        weights, experts = self.route_folded(hidden, norm)
        w13, w2 = self.experts.w13, self.experts.w2
        scales = (w13.scales, w2.scales)
        return fused_moe(hidden, w13.weight, w2.weight, weights, experts, scales=scales, norm=norm, residual=residual)

    def routed_experts(self) -> RoutedExperts:
        return RoutedExperts(self.num_experts, self.top_k, (self.experts.w13.weight, self.experts.w2.weight))

    def quantize(self, method: str) -> None:
        """`quantize_linears` for the experts: float8 rows ("fp8"); other methods keep them."""
        if method == "fp8":
            self.experts.w13.quantize_fp8()
            self.experts.w2.quantize_fp8()

    def mix_experts(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The sum over each token's chosen experts, weighted; fused on CUDA."""
        if ops.runs_kernels(hidden):
            from kestrel.layers.fused_moe import fused_moe

            w13, w2 = self.experts.w13, self.experts.w2
            out = fused_moe(hidden, w13.weight, w2.weight, weights, experts, scales=(w13.scales, w2.scales))
        elif torch.compiler.is_compiling():
            out = self.gathered(hidden, weights, experts)
        else:
            out = self.grouped(hidden, weights, experts)
        return self.parallel.all_reduce(out)  # each rank computed its slice of every expert

    def gathered(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The compiled path (`per_choice`): no host sync, each choice's expert read once."""
        inputs, chosen = per_choice(hidden, experts)
        gate, up = choice_linear(inputs, self.experts.w13.expert(chosen, hidden.dtype)).chunk(2, dim=-1)
        down = choice_linear(F.silu(gate) * up, self.experts.w2.expert(chosen, hidden.dtype))
        return sum_choices(down, experts.shape[1], weights)

    def grouped(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The torch path: one matmul per expert over its tokens (reads counts to the host)."""
        out = torch.zeros_like(hidden)
        w13, w2 = self.experts.w13, self.experts.w2
        for expert, rows, row_weights in tokens_by_expert(experts, weights, self.num_stacked):
            gate, up = ops.linear(hidden[rows], w13.expert(expert, hidden.dtype)).chunk(2, dim=-1)
            expert_out = ops.linear(F.silu(gate) * up, w2.expert(expert, hidden.dtype))
            out.index_add_(0, rows, expert_out * row_weights[:, None])
        return out


def append_always_on(
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_routed: int,
    count: int,
    shared_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed choices [tokens, k] followed by `count` always-on experts (stacked from index
    `num_routed`), each weighted by the sigmoid of its column of `shared_logits`, or by 1."""
    if not count:
        return weights, experts
    tokens = weights.shape[0]
    if shared_logits is None:
        shared = weights.new_ones((tokens, count))
    else:
        shared = torch.sigmoid(shared_logits.float()).to(weights.dtype)
    always_on = torch.arange(num_routed, num_routed + count, device=experts.device, dtype=experts.dtype)
    return torch.cat((weights, shared), dim=1), torch.cat((experts, always_on.expand(tokens, count)), dim=1)


def per_choice(hidden: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's row once per expert it chose, and those experts: [tokens * k, hidden] and
    [tokens * k]. The graph-safe way to run experts (compiled steps): every choice gathers its
    expert's weights and runs batched matvecs, with no expert counts read to the host. It reads
    an expert once per choice of it, which suits decode steps of a few rows."""
    return hidden.repeat_interleave(experts.shape[1], dim=0), experts.flatten()


def choice_linear(inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """inputs [n, in] each times its own weight of weights [n, out, in]: [n, out]."""
    return torch.bmm(weights, inputs[:, :, None])[..., 0]


def sum_choices(outputs: torch.Tensor, choices: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """outputs [tokens * choices, hidden] summed over each token's choices, weighted by weights
    [tokens, choices] where given."""
    per_token = outputs.view(-1, choices, outputs.shape[-1])
    return (per_token if weights is None else per_token * weights[..., None]).sum(dim=1)


def tokens_by_expert(
    experts: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, the rows of the tokens that chose it, their weights) for every expert chosen,
    from experts and weights [tokens, choices]: one sort, one count read to the host."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token_rows, token_weights = order // experts.shape[1], weights.flatten()[order]
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            yield expert, token_rows[start : start + count], token_weights[start : start + count]
            start += count


# The checkpoint names of each expert's projections in Qwen's and DeepSeek's
# layouts (`mlp.experts.<e>.gate_proj`, ...), by the stacked part each fills.
EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def stacked_target(part: str) -> str:
    """The stacked weight a projection part fills: down -> w2, gate and up -> w13."""
    return "mlp.experts.w2" if part == "down" else "mlp.experts.w13"


def expert_mappings(num_experts: int, source_prefix: str, names: dict[str, str]) -> list[PackedMapping]:
    """Checkpoint names `<prefix>.experts.<e>.<name>` -> the stacked weights' shards.

    `names` maps each checkpoint projection name to its part: gate, up or down.
    """
    mappings = []
    for expert in range(num_experts):
        for name, part in names.items():
            source = f"{source_prefix}.experts.{expert}.{name}"
            mappings.append(PackedMapping(source, stacked_target(part), f"{expert}:{part}"))
    return mappings
