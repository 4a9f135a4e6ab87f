"""GptOssForCausalLM (gpt-oss-20b, gpt-oss-120b): sliding-window layers between full ones, an
attention sink per query head, biases on every attention projection, and a mixture of
experts with a router bias, expert biases and a clamped gated activation.

The checkpoint keeps each layer's experts in one tensor per projection, transposed against a
linear layer's weight, with gate and up interleaved column by column (`gate_up_proj`
[experts, hidden, 2 * inter]); `GptOssExperts` turns that into gate rows then up rows once, at
load. Expert weights stored as MXFP4 (the published checkpoints) arrive dequantized
(weights/mxfp4.py). On CUDA the experts run in the fused MoE (`ExpertForm`: biases and the
clamped SwiGLU), elsewhere in torch; the attention backends all take sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import WeightBindings, copy_whole
from kestrel.layers import ops
from kestrel.layers.fused_moe import CLAMPED_SWIGLU, SWIGLU_ALPHA, SWIGLU_LIMIT, ExpertForm
from kestrel.layers.linear import Linear, RowParallelLinear, copy_into
from kestrel.layers.moe import RoutedExperts, choice_linear, per_choice, sum_choices, tokens_by_expert
from kestrel.models.dense import (
    DecoderAttention,
    DecoderForCausalLM,
    DenseDecoderRecipe,
    ResidualBlock,
    decoder_bindings,
    rank_slice,
    read_dense_spec,
    read_rope,
)
from kestrel.models.spec import FULL_ATTENTION, SLIDING_ATTENTION, DecoderSpec, MoeSpec


class GptOssAttention(DecoderAttention):
    """Llama-shaped attention with biases on q, k, v and o, and a learned sink logit per head."""

    def __init__(self, spec: DecoderSpec, index: int, parallel: TensorParallel) -> None:
        super().__init__(spec, index, parallel)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, parallel, bias=True)
        self.heads = rank_slice(parallel, spec.num_heads, "num_attention_heads")
        self.sinks = nn.Parameter(torch.empty(self.heads.size), requires_grad=False)

    # The sinks are this module's own parameter: each rank keeps its heads' share.
    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        copy_into(param.data, self.heads.take(tensor, 0, "attention sinks"), "attention sinks")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's activation of [rows, 2 * inter] (gate then up): the gate clamped above and
    squashed by sigmoid(alpha * gate), the up clamped both ways and shifted by one."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


class GptOssExperts(nn.Module):
    """Every expert's projections and biases, as linear layers hold them: gate_up_proj
    [experts, 2 * inter, hidden] (gate rows, then up rows) and down_proj [experts, hidden, inter];
    under tensor parallelism each rank keeps its share of the intermediate width."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        super().__init__()
        moe = spec.moe
        self.inner = rank_slice(parallel, moe.intermediate_size, "intermediate_size")
        experts, hidden, inner = moe.num_experts, spec.hidden_size, self.inner.size

        def parameter(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.gate_up_proj = parameter(experts, 2 * inner, hidden)
        self.gate_up_proj_bias = parameter(experts, 2 * inner)
        self.down_proj = parameter(experts, hidden, inner)
        self.down_proj_bias = parameter(experts, hidden)  # added once, after the ranks' sum

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        what = "GPT-OSS experts"
        if param is self.gate_up_proj or param is self.gate_up_proj_bias:
            # Checkpoint: [experts, (hidden,) 2 * inter], gate and up alternating column by column.
            gate, up = tensor[..., 0::2], tensor[..., 1::2]
            dim = gate.dim() - 1
            stacked = torch.cat((self.inner.take(gate, dim, what), self.inner.take(up, dim, what)), dim=dim)
            tensor = stacked.transpose(1, 2) if param is self.gate_up_proj else stacked
        elif param is self.down_proj:  # checkpoint [experts, inter, hidden]
            tensor = self.inner.take(tensor, 1, what).transpose(1, 2)
        copy_whole(param, tensor)  # bindings name the tensor in any shape error


class GptOssMoe(nn.Module):
    """Top-k over the router's logits (router bias included), softmax over the k chosen, then
    each expert over its tokens: one matmul per expert, the Python loop never per token."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        super().__init__()
        self.top_k, self.parallel = spec.moe.top_k, parallel
        self.router = Linear(spec.hidden_size, spec.moe.num_experts, bias=True)  # replicated
        self.experts = GptOssExperts(spec, parallel)

    def folds(self, hidden: torch.Tensor) -> bool:
        """Whether a one-row `hidden` takes the router's matvec and the expert matvecs, which
        fold an input norm and a residual add (one rank: the residual joins after the sum)."""
        return self.parallel.size == 1 and self.router.folds(hidden)

    def forward(
        self, hidden: torch.Tensor, norm: ops.RowNorm | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts' mix of norm(hidden) (with `norm`; else of hidden as given), plus
        `residual`: inside the router's and the experts' matvecs where they fold them."""
        if norm is not None or residual is not None:
            return self._forward_folded(hidden, norm, residual)
        router = self.router
        if ops.takes_gemv(hidden, router.use_gemv):
            from kestrel.layers.fused_moe import gemv_route

            num_experts = router.out_features
            return self._fused(hidden, *gemv_route(hidden, router.weight, router.bias, num_experts, self.top_k, True))
        logits = router(hidden)
        if ops.runs_kernels(hidden):
            # A softmax over the top k logits is the full softmax renormalised over them: the
            # fused routing kernel's (one launch, where top-k and softmax took three; at one
            # row, the router's matvec routes as well).
            from kestrel.layers.fused_moe import route

            return self._fused(hidden, *route(logits, self.top_k, True, hidden.dtype))
        top, experts = logits.topk(self.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=top.dtype)
        out = self.parallel.all_reduce(self._experts(hidden, weights, experts))
        bias = self.experts.down_proj_bias[experts]  # [tokens, k, hidden]
        return out + (weights[..., None] * bias).sum(dim=1).to(out.dtype)

    def _forward_folded(
        self, hidden: torch.Tensor, norm: ops.RowNorm | None, residual: torch.Tensor | None
    ) -> torch.Tensor:
        if not self.folds(hidden):
            normed = hidden if norm is None else ops.rms_norm(hidden, norm.weight, norm.eps)
            out = self(normed)
            return out if residual is None else out + residual
        from kestrel.layers.fused_moe import gemv_route

        router = self.router
        routed = gemv_route(hidden, router.weight, router.bias, router.out_features, self.top_k, True, norm=norm)
        return self._fused(hidden, *routed, norm, residual)

    def _fused(
        self,
        hidden: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        norm: ops.RowNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fused MoE (of norm(hidden) with `norm`; plus `residual`, on one rank alone)."""
        from kestrel.layers.fused_moe import fused_moe

        params = self.experts
        # The down bias is added once: by rank 0 alone, before the ranks' partial sums meet.
        down_bias = params.down_proj_bias if self.parallel.rank == 0 else None
        form = ExpertForm(CLAMPED_SWIGLU, params.gate_up_proj_bias, down_bias)
        experts_of = dict(form=form, norm=norm, residual=residual)
        out = fused_moe(hidden, params.gate_up_proj, params.down_proj, weights, experts, **experts_of)
        return self.parallel.all_reduce(out)

    def routed_experts(self) -> RoutedExperts:
        params = self.experts
        tensors = (params.gate_up_proj, params.gate_up_proj_bias, params.down_proj, params.down_proj_bias)
        return RoutedExperts(params.gate_up_proj.shape[0], self.top_k, tensors)

    def _experts(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        params = self.experts
        if torch.compiler.is_compiling():
            inputs, chosen = per_choice(hidden, experts)
            gate_up = choice_linear(inputs, params.gate_up_proj[chosen]) + params.gate_up_proj_bias[chosen]
            return sum_choices(choice_linear(swiglu(gate_up), params.down_proj[chosen]), self.top_k, weights)
        out = torch.zeros_like(hidden)
        for expert, rows, row_weights in tokens_by_expert(experts, weights, params.gate_up_proj.shape[0]):
            gate_up = ops.linear(hidden[rows], params.gate_up_proj[expert]) + params.gate_up_proj_bias[expert]
            down = ops.linear(swiglu(gate_up), params.down_proj[expert])
            out.index_add_(0, rows, down * row_weights[:, None])
        return out


class GptOssDecoderLayer(ResidualBlock):
    def __init__(self, spec: DecoderSpec, index: int, parallel: TensorParallel) -> None:
        super().__init__(spec)
        self.self_attn = GptOssAttention(spec, index, parallel)
        self.mlp = GptOssMoe(spec, parallel)


class GptOssRecipe(DenseDecoderRecipe):
    architectures = ("GptOssForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        layer_types = tuple(hf_config.layer_types)
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"GPT-OSS layer types {unknown} are not supported")
        moe = MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,  # softmax over the chosen k
        )
        return read_dense_spec(
            hf_config,
            "GptOssForCausalLM",
            rope=read_rope(hf_config),
            attention_bias=True,
            attention_sinks=True,
            sliding_window=hf_config.sliding_window,
            layer_types=layer_types,
            moe=moe,
        )

    def build(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return DecoderForCausalLM(spec, parallel, GptOssDecoderLayer)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return decoder_bindings(model, spec)
