"""Llama4ForCausalLM (Llama 4 Scout / Maverick, text): chunked local attention in most layers
and full attention without rope in every fourth (whose queries are scaled up with the
position, "temperature tuning"), an L2 norm on the rope layers' queries and keys, and
mixture-of-experts layers (every `interleave_moe_layer_step`-th) whose router scores scale the
experts' input (a sigmoid of the top logits), beside a shared expert.

Llama 4 rotates adjacent pairs of each head's dimensions (complex-number rope); its q and k
rows are permuted once at load so that the usual half-split rotary computes the same scores
(a permutation of every head's dimensions, the same in q and k, leaves q . k and the L2 norm
unchanged). On CUDA the routed experts run in the fused MoE, their routing weights scaling
the experts' input (`ExpertForm.weights_scale_input`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.forward import ForwardContext
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import SkippedPrefix, WeightBindings, copy_whole
from kestrel.layers import ops
from kestrel.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kestrel.layers.moe import RoutedExperts, choice_linear, per_choice, sum_choices, tokens_by_expert
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import rotary_cos_sin
from kestrel.models.dense import (
    DecoderForCausalLM,
    DecoderMLP,
    DenseDecoderRecipe,
    attention_layer_spec,
    attention_shards,
    decoder_bindings,
    rank_slice,
    read_dense_spec,
)
from kestrel.models.spec import CHUNKED_ATTENTION, FULL_ATTENTION, DecoderSpec, MoeSpec


@dataclass(frozen=True)
class Llama4Config:
    """What Llama 4 adds to the decoder spec, per model."""

    rope_layers: tuple[bool, ...]  # per layer: rope (chunked) or none (full attention)
    qk_norm: bool
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    shared_expert_size: int


@dataclass(frozen=True, kw_only=True)
class Llama4Spec(DecoderSpec):
    llama4: Llama4Config


@dataclass(frozen=True)
class Llama4Step:
    """Per step, shared by the layers: the rope tables, and the no-rope layers' query scales."""

    rotary: tuple[torch.Tensor, torch.Tensor]
    query_scales: torch.Tensor | None  # [tokens]


def paired_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head's rows (dims 0, 1, 2, 3, ...) reordered as (0, 2, 4, ..., 1, 3, 5, ...): the
    pairs a complex-number rope rotates become the (i, i + dim / 2) pairs a half-split one does."""
    heads = rows.unflatten(0, (-1, head_dim // 2, 2))
    return heads.transpose(1, 2).flatten(0, 2)


class PairedRopeQkv(ColumnParallelLinear):
    """The q, k, v projection of a model whose rope rotates adjacent pairs."""

    def __init__(self, in_features: int, shards: dict, head_dim: int, bias: bool) -> None:
        super().__init__(in_features, shards, bias=bias)
        self.head_dim = head_dim

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        if shard_id in ("q", "k"):
            tensor = paired_to_halves(tensor, self.head_dim)
        super().load_shard(param, tensor, shard_id)


class Llama4Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int, parallel: TensorParallel, config: Llama4Config) -> None:
        super().__init__()
        self.layer_index = index
        self.layer_spec = attention_layer_spec(spec, parallel, index)
        self.qkv_proj = PairedRopeQkv(
            spec.hidden_size, attention_shards(spec, parallel), spec.head_dim, spec.attention_bias
        )
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, parallel, spec.attention_bias)
        self.uses_rope = config.rope_layers[index]
        self.qk_norm = config.qk_norm and self.uses_rope
        self.eps = spec.rms_norm_eps

    def forward(self, hidden: torch.Tensor, step: Llama4Step, context: ForwardContext) -> torch.Tensor:
        spec = self.layer_spec
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        query = query.view(tokens, spec.num_heads, spec.head_dim)
        key = key.view(tokens, spec.num_kv_heads, spec.head_dim)
        if self.uses_rope:
            cos, sin = step.rotary
            if self.qk_norm:
                # An L2 norm without weights commutes with the rotation: norm first, in one op.
                ones = query.new_ones(spec.head_dim)
                query, key = ops.qk_norm_rotary(query, key, ones, ones, self.eps, cos, sin)
            else:
                query, key = ops.rotary(query, cos, sin), ops.rotary(key, cos, sin)
        elif step.query_scales is not None:
            query = (query * step.query_scales[:, None, None]).to(query.dtype)
        value = value.view(tokens, spec.num_kv_heads, spec.head_dim)
        attended = context.attend(self.layer_index, query, key, value, spec)
        return self.o_proj(attended.reshape(tokens, spec.num_heads * spec.head_dim))


class Llama4Experts(nn.Module):
    """Every expert's projections as linear layers hold them: gate_up_proj [experts, 2 * inter,
    hidden] (the checkpoint's [experts, hidden, 2 * inter], gate columns then up) and down_proj
    [experts, hidden, inter]; each rank keeps its share of the intermediate width."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        super().__init__()
        moe = spec.moe
        self.inner = rank_slice(parallel, moe.intermediate_size, "intermediate_size")
        experts, hidden, inner = moe.num_experts, spec.hidden_size, self.inner.size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner), requires_grad=False)

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        what = "Llama 4 experts"
        if param is self.gate_up_proj:
            gate, up = tensor.chunk(2, dim=2)
            tensor = torch.cat((self.inner.take(gate, 2, what), self.inner.take(up, 2, what)), dim=2).transpose(1, 2)
        else:
            tensor = self.inner.take(tensor, 1, what).transpose(1, 2)
        copy_whole(param, tensor)  # bindings name the tensor in any shape error


class Llama4Moe(nn.Module):
    """The routed experts, each fed its tokens scaled by their router score (sigmoid of the
    chosen logits), plus a shared expert every token takes."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel, config: Llama4Config) -> None:
        super().__init__()
        self.top_k, self.parallel = spec.moe.top_k, parallel
        self.router = Linear(spec.hidden_size, spec.moe.num_experts)  # replicated
        self.experts = Llama4Experts(spec, parallel)
        self.shared_expert = DecoderMLP(spec, parallel, config.shared_expert_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        top, experts = self.router(hidden).topk(self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(hidden.dtype)
        if ops.runs_kernels(hidden):
            from kestrel.layers.fused_moe import ExpertForm, fused_moe

            params, form = self.experts, ExpertForm(weights_scale_input=True)
            routed = fused_moe(hidden, params.gate_up_proj, params.down_proj, scores, experts, form=form)
        else:
            routed = self._experts(hidden, scores, experts)
        return self.shared_expert(hidden) + self.parallel.all_reduce(routed)

    def routed_experts(self) -> RoutedExperts:
        params = self.experts
        return RoutedExperts(params.gate_up_proj.shape[0], self.top_k, (params.gate_up_proj, params.down_proj))

    def _experts(self, hidden: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        params = self.experts
        if torch.compiler.is_compiling():
            inputs, chosen = per_choice(hidden, experts)
            scaled = inputs * scores.reshape(-1, 1)
            gate, up = choice_linear(scaled, params.gate_up_proj[chosen]).chunk(2, dim=-1)
            return sum_choices(choice_linear(F.silu(gate) * up, params.down_proj[chosen]), self.top_k)
        out = torch.zeros_like(hidden)
        for expert, rows, row_scores in tokens_by_expert(experts, scores, params.gate_up_proj.shape[0]):
            gate, up = ops.linear(hidden[rows] * row_scores[:, None], params.gate_up_proj[expert]).chunk(2, dim=-1)
            out.index_add_(0, rows, ops.linear(F.silu(gate) * up, params.down_proj[expert]))
        return out


class Llama4DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int, parallel: TensorParallel, config: Llama4Config) -> None:
        super().__init__()
        self.self_attn = Llama4Attention(spec, index, parallel, config)
        self.feed_forward = (
            Llama4Moe(spec, parallel, config) if spec.is_moe_layer(index) else DecoderMLP(spec, parallel)
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, step: Llama4Step, context: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `ResidualBlock`: each residual add happens inside the next norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(hidden, step, context), residual)
        return self.feed_forward(hidden), residual


class Llama4ForCausalLM(DecoderForCausalLM):
    def __init__(self, spec: Llama4Spec, parallel: TensorParallel = SINGLE) -> None:
        def layer(spec: Llama4Spec, index: int, parallel: TensorParallel) -> Llama4DecoderLayer:
            return Llama4DecoderLayer(spec, index, parallel, spec.llama4)

        super().__init__(spec, parallel, layer)
        self.llama4 = spec.llama4

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        config = self.llama4
        scales = None
        if config.temperature_tuning:
            floors = torch.floor((positions.float() + 1.0) / config.floor_scale)
            scales = torch.log1p(floors) * config.attn_scale + 1.0
        step = Llama4Step(rotary_cos_sin(positions, self.spec.rope, self.spec.rotary_dim, hidden.dtype), scales)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, step, context)
        return self.model.norm(hidden, residual)[0]


def _config(hf_config: object) -> Llama4Config:
    return Llama4Config(
        rope_layers=tuple(bool(flag) for flag in hf_config.no_rope_layers),
        qk_norm=bool(hf_config.use_qk_norm),
        temperature_tuning=bool(hf_config.attn_temperature_tuning),
        floor_scale=float(hf_config.floor_scale),
        attn_scale=float(hf_config.attn_scale),
        shared_expert_size=hf_config.intermediate_size,
    )


class Llama4Recipe(DenseDecoderRecipe):
    architectures = ("Llama4ForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        layer_types = tuple(hf_config.layer_types)
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, CHUNKED_ATTENTION})
        if unknown:
            raise ValueError(f"Llama 4 layer types {unknown} are not supported")
        rope_layers = [bool(flag) for flag in hf_config.no_rope_layers]
        if [kind == CHUNKED_ATTENTION for kind in layer_types] != rope_layers:
            raise ValueError("Llama 4 configs whose chunked layers are not exactly its rope layers are not supported")
        step = hf_config.interleave_moe_layer_step
        moe = MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=False,
            sparse_step=step,
        )
        if list(getattr(hf_config, "moe_layers", [])) != [
            i for i in range(hf_config.num_hidden_layers) if moe.is_sparse(i)
        ]:
            raise ValueError(
                "Llama 4 configs whose moe_layers are not every interleave_moe_layer_step-th are not supported"
            )
        spec = read_dense_spec(
            hf_config,
            "Llama4ForCausalLM",
            intermediate_size=hf_config.intermediate_size_mlp,  # the dense layers' MLP
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            attention_chunk_size=hf_config.attention_chunk_size,
            layer_types=layer_types,
            moe=moe,
        )
        fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
        return Llama4Spec(**fields, llama4=_config(hf_config))

    def build(self, spec: Llama4Spec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return Llama4ForCausalLM(spec, parallel)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return decoder_bindings(model, spec)


class Llama4VisionLanguageRecipe(Llama4Recipe):
    """A Llama 4 release (`Llama4ForConditionalGeneration`, as Meta publishes Scout and
    Maverick): its `text_config` and `language_model.*` weights; the vision tower is skipped."""

    architectures = ("Llama4ForConditionalGeneration",)

    def spec(self, hf_config: object) -> Llama4Spec:
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise ValueError("a Llama 4 vision-language config has no text_config")
        return super().spec(text)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        skipped = tuple(
            SkippedPrefix(prefix, "the vision tower (Kestrel serves the text model)")
            for prefix in ("vision_model.", "multi_modal_projector.")
        )
        return decoder_bindings(model, spec, skipped=skipped, renamed_prefixes={"language_model.": ""})
