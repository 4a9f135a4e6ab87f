"""DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (DeepSeek-V2, V2-Lite, V2.5, V3, R1):
multi-head latent attention, and mixtures of experts with shared experts after the first
dense layers.

Multi-head latent attention (MLA) keeps one latent per token and layer: the key/value
projection's `kv_lora_rank` dims (RMS-normed) followed by a rotary key part shared by every
head. Each head's key and value are up-projections of that latent (`kv_b_proj`), so a head's
score is q_nope . (W_k c) + q_rope . k_rope = (W_k^T q_nope) . c + q_rope . k_rope: the query
is absorbed into the latent's space once per token, and attention runs as one-KV-head
attention over [latent, rotary] keys whose values are the latents themselves
(`AttentionLayerSpec.latent_dim`: the pool stores keys only). Each head's output latent is
projected up by W_v afterwards. The cache is `kv_lora_rank + qk_rope_head_dim` values per
token and layer: 576 for DeepSeek-V3, where a plain cache of its 128 heads would hold 32,768.

DeepSeek rotates adjacent pairs of the rotary dims (V2 always, V3 with `rope_interleave`); those
rows of the query and key projections are reordered once at load so that the half-split
rotary computes the same scores (the same permutation on both sides of each dot product).

Routing: V2 takes a softmax and the top-k experts, over the best `topk_group` groups where
`topk_method` is "group_limited_greedy" (a group ranked by its best expert); V3 takes a sigmoid,
adds a per-expert correction bias for the choice only, ranks groups by their two best experts,
renormalises the chosen weights (`norm_topk_prob`); both scale them by `routed_scaling_factor`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from kestrel.core.forward import ForwardContext
from kestrel.core.layer_spec import LayerSpec
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import PackedMapping, SkippedPrefix, WeightBindings
from kestrel.layers import ops
from kestrel.layers.embedding import VocabParallelEmbedding, vocab_rows
from kestrel.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, ShardSlice
from kestrel.layers.moe import EXPERT_PROJECTIONS, SparseMoe, append_always_on, expert_mappings, stacked_target
from kestrel.layers.norm import RMSNorm
from kestrel.models.dense import (
    MLP_MAPPINGS,
    DecoderForCausalLM,
    DecoderMLP,
    ResidualBlock,
    attention_layer_spec,
    decoder_bindings,
    rank_slice,
    read_dense_spec,
    read_rope,
)
from kestrel.models.llama4 import paired_to_halves
from kestrel.models.mtp import TARGET_NORM, MtpDraft
from kestrel.models.spec import DecoderSpec, MoeSpec

SOFTMAX, SIGMOID = "softmax", "sigmoid"


@dataclass(frozen=True)
class MlaConfig:
    """The shape of multi-head latent attention."""

    q_lora_rank: int | None  # the query's own low-rank bottleneck (None: one q_proj)
    kv_lora_rank: int
    nope_dim: int  # each head's key dims without rotary
    rope_dim: int
    value_dim: int
    paired_rope: bool  # the checkpoint's rotary rotates adjacent pairs

    @property
    def query_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class RoutingConfig:
    scoring: str  # SOFTMAX (V2) or SIGMOID (V3)
    num_groups: int  # 1: no group limit
    topk_groups: int
    scaling_factor: float
    correction_bias: bool  # V3: a per-expert bias added to the scores for the choice alone


@dataclass(frozen=True, kw_only=True)
class DeepseekSpec(DecoderSpec):
    mla: MlaConfig
    routing: RoutingConfig
    shared_experts: int
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint appends after the decoder's
    first_mtp_layer: int = 0  # the checkpoint index of the first: the target's num_hidden_layers

    def _layer_spec(self, index: int) -> LayerSpec:
        return dataclasses.replace(super()._layer_spec(index), latent_dim=self.mla.kv_lora_rank)

    @property
    def rotary_dim(self) -> int:
        return self.mla.rope_dim


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, config: RoutingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [tokens, top_k] from the router's float32 logits, as transformers'
    DeepSeek routers choose them."""
    scores = logits.sigmoid() if config.scoring == SIGMOID else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if config.num_groups > 1:
        v3 = config.scoring == SIGMOID
        groups = choice.view(choice.shape[0], config.num_groups, -1)
        # V3 ranks a group by its two best experts, V2 by its best one.
        best = groups.topk(2, dim=-1).values.sum(dim=-1) if v3 else groups.amax(dim=-1)
        kept = torch.zeros_like(best, dtype=torch.bool)
        kept.scatter_(1, best.topk(config.topk_groups, dim=-1).indices, True)
        dropped = ~kept[:, :, None].expand_as(groups).reshape_as(choice)
        # V2 zeroes the dropped groups' scores (softmax scores are positive), V3 excludes them.
        choice = choice.masked_fill(dropped, float("-inf") if v3 else 0.0)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.scaling_factor, experts


class DeepseekRouter(Linear):
    """The router's weight [experts, hidden], and V3's score correction bias."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__(hidden_size, num_experts)
        bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        self.e_score_correction_bias = bias


class DeepseekMoe(SparseMoe):
    """Routed experts and the shared experts every token takes, in one fused MoE on CUDA.

    The checkpoint's shared MLP (`n_shared_experts` experts' width in one tensor) is stacked
    after the routed experts as `n_shared_experts` always-on experts of the routed width,
    each chosen by every token with weight 1: split along its intermediate dim, it computes
    the same sum, and the separate matvecs and add a shared MLP cost are gone."""

    def __init__(self, spec: DeepseekSpec, parallel: TensorParallel) -> None:
        moe = spec.moe
        stacked = moe.num_experts + spec.shared_experts
        super().__init__(
            *(spec.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize, parallel),
            num_stacked=stacked,
            always_on_combined=True,
        )
        self.routing = spec.routing
        self.gate = DeepseekRouter(spec.hidden_size, moe.num_experts, spec.routing.correction_bias)

    def folds(self, hidden: torch.Tensor) -> bool:
        """V2's greedy softmax routing (the routing kernel, on logits in the model's dtype): its
        router's matvec folds a norm; V3's float32 scores are computed from the row itself."""
        return self._routes_greedily(hidden) and self.parallel.size == 1 and self.gate.folds(hidden)

    def route_folded(self, hidden: torch.Tensor, norm: ops.RowNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pick_greedily(self.gate(hidden, norm), hidden.dtype)

    def _routes_greedily(self, hidden: torch.Tensor) -> bool:
        return ops.runs_kernels(hidden) and self.routing.scoring == SOFTMAX and self.routing.num_groups == 1

    def _pick_greedily(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pick(logits, dtype, always_on=True, routed_scale=self.routing.scaling_factor)

    def route(
        self, hidden: torch.Tensor, shared_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed choices, then the shared experts (weight 1)."""
        if self._routes_greedily(hidden):
            # V2's greedy top-k of a softmax: the fused routing kernel, on the router's logits
            # in the model's dtype (where float32 logits took four launches more).
            return self._pick_greedily(self.gate(hidden), hidden.dtype)
        # Scores in float32, as transformers computes them: a near tie picks the same expert.
        logits = torch.nn.functional.linear(hidden.float(), self.gate.weight.float())
        weights, experts = route(logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize, self.routing)
        return append_always_on(weights.to(hidden.dtype), experts, self.num_experts, self.num_always_on)


class PairedRopeRows(ColumnParallelLinear):
    """A projection whose parts hold, per head, `nope` dims then `rope` dims rotated in
    adjacent pairs (`rope_layouts`: a part's (nope, rope) widths; parts not named have no rope
    rows): the rope rows are reordered at load into the half-split layout."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str | None, ShardSlice],
        rope_layouts: dict[str | None, tuple[int, int]],
        paired: bool,
        **kwargs,
    ) -> None:
        super().__init__(in_features, shards, **kwargs)
        self.rope_layouts, self.paired = rope_layouts, paired

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        nope, rope = self.rope_layouts.get(shard_id, (0, 0))
        if self.paired and rope and param is self.weight and tensor.shape[0] % (nope + rope) == 0:
            heads = tensor.unflatten(0, (-1, nope + rope))
            halves = paired_to_halves(heads[:, nope:].flatten(0, 1), rope)
            tensor = torch.cat((heads[:, :nope], halves.unflatten(0, (-1, rope))), dim=1).flatten(0, 1)
        super().load_shard(param, tensor, shard_id)


# The two projections of the layer's input, stacked into one (`MlaAttention.input_proj`): the
# query's (V2) or its low-rank bottleneck's (V3), then the latent's.
MLA_MAPPINGS = (
    PackedMapping("self_attn.q_proj", "self_attn.input_proj", "query"),
    PackedMapping("self_attn.q_a_proj", "self_attn.input_proj", "query"),
    PackedMapping("self_attn.kv_a_proj_with_mqa", "self_attn.input_proj", "latent"),
)


class MlaAttention(nn.Module):
    def __init__(self, spec: DeepseekSpec, index: int, parallel: TensorParallel) -> None:
        super().__init__()
        mla = spec.mla
        self.mla, self.layer_index = mla, index
        self.layer_spec = attention_layer_spec(spec, parallel, index)
        self.num_heads = self.layer_spec.num_heads  # this rank's
        heads = rank_slice(parallel, spec.num_heads * mla.query_dim, "num_attention_heads")
        paired = mla.paired_rope
        # The latent and the shared rotary key: one "head" of kv_lora_rank + rope dims,
        # whose first kv_lora_rank dims are not rotated.
        latent = {"latent": ShardSlice.whole(mla.kv_lora_rank + mla.rope_dim)}
        rope_layouts = {"latent": (mla.kv_lora_rank, mla.rope_dim)}
        if mla.q_lora_rank is None:
            query = {"query": heads}
            rope_layouts["query"] = (mla.nope_dim, mla.rope_dim)
        else:
            query = {"query": ShardSlice.whole(mla.q_lora_rank)}
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, spec.rms_norm_eps)
            head_rope = {None: (mla.nope_dim, mla.rope_dim)}
            self.q_b_proj = PairedRopeRows(mla.q_lora_rank, {None: heads}, head_rope, paired)
        # The query's projection and the latent's read the same input: one matvec (one GEMM)
        # for both, where two launches a layer were most of a decode step's fixed cost.
        self.input_proj = PairedRopeRows(
            spec.hidden_size, query | latent, rope_layouts, paired, bias=spec.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, spec.rms_norm_eps)
        # Read as two per-head matrices (`_up_projections`), never packed by quantization.
        up_rows = rank_slice(parallel, spec.num_heads * (mla.nope_dim + mla.value_dim), "num_attention_heads")
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, {None: up_rows}, quantizable=False)
        self.o_proj = RowParallelLinear(spec.num_heads * mla.value_dim, spec.hidden_size, parallel, spec.attention_bias)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head, W_k [heads, nope, latent] and W_v [heads, value, latent]: views of kv_b_proj."""
        mla = self.mla
        per_head = self.kv_b_proj.weight.view(self.num_heads, mla.nope_dim + mla.value_dim, mla.kv_lora_rank)
        return per_head[:, : mla.nope_dim], per_head[:, mla.nope_dim :]

    def _query(self, projected: torch.Tensor) -> torch.Tensor:
        """The query from the input projection's query part (V3: through its bottleneck)."""
        if self.mla.q_lora_rank is None:
            return projected
        return self.q_b_proj(self.q_a_layernorm(projected))

    def folds(self, hidden: torch.Tensor) -> bool:
        """Whether a one-row `hidden` takes matvecs that fold the input norm (the input
        projection reads it) and the residual add."""
        return self.input_proj.folds(hidden) and self.o_proj.folds(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
        norm: ops.RowNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over norm(hidden) (with `norm`; else hidden as given), plus `residual`."""
        mla, tokens = self.mla, hidden.shape[0]
        cos, sin = rotary
        query_part, latent = self.input_proj.split(self.input_proj(hidden, norm))
        query = self._query(query_part).view(tokens, self.num_heads, mla.query_dim)
        latent_norm = self.kv_a_layernorm
        latent_key = ops.LatentKey(latent, latent_norm.effective_weight, latent_norm.eps)
        key_up, value_up = self._up_projections()
        absorbed, key = ops.latent_query_and_key(query, key_up, latent_key, cos, sin)
        attended = context.attend(self.layer_index, absorbed, key, key[..., : mla.kv_lora_rank], self.layer_spec)
        return self.o_proj(ops.latent_values(attended, value_up), residual)


class DeepseekDecoderLayer(ResidualBlock):
    def __init__(self, spec: DeepseekSpec, index: int, parallel: TensorParallel) -> None:
        super().__init__(spec)
        self.self_attn = MlaAttention(spec, index, parallel)
        self.mlp = DeepseekMoe(spec, parallel) if spec.is_moe_layer(index) else DecoderMLP(spec, parallel)


def _softmax_scale(hf_config: object, query_dim: int) -> float:
    """query_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the config
    scales its rope that way (transformers' `yarn_apply_mscale`)."""
    scale = query_dim**-0.5
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    weight, factor = params.get("mscale_all_dim") or 0, params.get("factor") or 1.0
    if params.get("rope_type", params.get("type", "default")) != "default" and weight and factor > 1:
        mscale = 0.1 * weight * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekRecipe:
    """Both generations: V2's fields where V3's are absent."""

    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    v3 = False

    def spec(self, hf_config: object) -> DeepseekSpec:
        mla = MlaConfig(
            q_lora_rank=hf_config.q_lora_rank,
            kv_lora_rank=hf_config.kv_lora_rank,
            nope_dim=hf_config.qk_nope_head_dim,
            rope_dim=hf_config.qk_rope_head_dim,
            value_dim=hf_config.v_head_dim,
            paired_rope=bool(getattr(hf_config, "rope_interleave", True)) if self.v3 else True,
        )
        moe = MoeSpec(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            renormalize=self.v3 and bool(hf_config.norm_topk_prob),  # transformers' V2 never does
            dense_layers=tuple(range(hf_config.first_k_dense_replace)),
        )
        spec = read_dense_spec(
            hf_config,
            self.architectures[0],
            num_kv_heads=1,
            head_dim=mla.kv_lora_rank + mla.rope_dim,  # what attention sees: one latent "head"
            attention_scale=_softmax_scale(hf_config, mla.query_dim),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            rope=read_rope(hf_config),
            moe=moe,
        )
        if spec.attention_bias and mla.q_lora_rank is None:
            # The query's and the latent's projections are stacked (MlaAttention.input_proj),
            # and a query projection of its own (no q_lora_rank) has no bias where the latent's has one.
            raise ValueError(f"{self.architectures[0]} with attention_bias and no q_lora_rank is not supported")
        fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec) if field.name != "layers"}
        return DeepseekSpec(
            **fields,
            mla=mla,
            routing=self._routing(hf_config),
            shared_experts=hf_config.n_shared_experts or 0,
            mtp_layers=getattr(hf_config, "num_nextn_predict_layers", None) or 0,
            first_mtp_layer=spec.num_layers,
        )

    def _routing(self, hf_config: object) -> RoutingConfig:
        scoring = SIGMOID if self.v3 else SOFTMAX
        declared = getattr(hf_config, "scoring_func", None)  # the original configs' field
        if declared is not None and declared != scoring:
            raise ValueError(
                f"{self.architectures[0]} with scoring_func {declared!r} is not supported; it routes by {scoring!r}"
            )
        groups = hf_config.n_group or 1
        if not self.v3 and getattr(hf_config, "topk_method", "greedy") == "greedy":
            groups = 1
        elif not self.v3 and hf_config.topk_method != "group_limited_greedy":
            raise ValueError(f"DeepSeek-V2 topk_method {hf_config.topk_method!r} is not supported")
        return RoutingConfig(
            scoring=scoring,
            num_groups=groups,
            topk_groups=hf_config.topk_group or 1,
            scaling_factor=float(hf_config.routed_scaling_factor),
            correction_bias=self.v3,
        )

    def build(self, spec: DeepseekSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        if not spec.shared_experts:
            raise ValueError("DeepSeek configs without shared experts (n_shared_experts = 0) are not supported")
        return DecoderForCausalLM(spec, parallel, DeepseekDecoderLayer)

    def bindings(self, model: nn.Module, spec: DeepseekSpec) -> WeightBindings:
        # V3 releases append their multi-token-prediction layers after the decoder's.
        mtp = tuple(
            SkippedPrefix(f"model.layers.{spec.first_mtp_layer + i}.", "multi-token prediction (the 'mtp' draft's)")
            for i in range(spec.mtp_layers)
        )
        return decoder_bindings(model, spec, self._experts(spec), skipped=mtp, mappings=MLA_MAPPINGS + MLP_MAPPINGS)

    def build_mtp(self, spec: DeepseekSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        """The checkpoint's MTP layer as speculative decoding's draft (models/mtp.py)."""
        return DeepseekMtpForCausalLM(spec, parallel)

    def mtp_bindings(self, model: nn.Module, spec: DeepseekSpec) -> WeightBindings:
        """The MTP layer's tensors, `model.layers.<first_mtp_layer>.*`, bound to the draft's `mtp.`;
        the target's layers, embeddings, norm and LM head skipped (the layer has its own)."""
        mtp_prefix = f"model.layers.{spec.first_mtp_layer}."
        target = "the target model's (the MTP layer carries its own)"
        skipped = (
            *(SkippedPrefix(f"model.layers.{i}.", "the target model's layers") for i in range(spec.first_mtp_layer)),
            SkippedPrefix("model.embed_tokens.", f"embeddings: {target}"),
            TARGET_NORM,
            SkippedPrefix("lm_head.", f"LM head: {target}"),
        )
        mappings = self._experts(spec) + MLA_MAPPINGS + MLP_MAPPINGS
        return WeightBindings(model, mappings, skipped=skipped, renamed_prefixes={mtp_prefix: "mtp."})

    @staticmethod
    def _experts(spec: DeepseekSpec) -> tuple[PackedMapping, ...]:
        """The routed experts, and the shared MLP split into always-on experts (`DeepseekMoe`)."""
        if not spec.moe:
            return ()
        shared = tuple(
            PackedMapping(f"mlp.shared_experts.{name}", stacked_target(part), f"shared:{part}")
            for name, part in EXPERT_PROJECTIONS.items()
        )
        return shared + tuple(expert_mappings(spec.moe.num_experts, "mlp", EXPERT_PROJECTIONS))


class DeepseekMtpLayer(DeepseekDecoderLayer):
    """A multi-token-prediction layer as DeepSeek-V3 stores it: a decoder layer with the head's
    own parts beside its attention and MLP (its embeddings, input norms and projection, and a
    final norm with an LM head)."""

    def __init__(self, spec: DeepseekSpec, parallel: TensorParallel) -> None:
        super().__init__(spec, 0, parallel)
        hidden = spec.hidden_size
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, hidden, parallel)
        self.enorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, spec.rms_norm_eps)
        rows = {None: vocab_rows(spec.vocab_size, parallel)}
        self.shared_head.head = ColumnParallelLinear(hidden, rows, quantizable=False)


class DeepseekMtpForCausalLM(MtpDraft):
    """DeepSeek's layout of the MTP draft (models/mtp.py)."""

    def __init__(self, spec: DeepseekSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__(spec, parallel)
        self.mtp = DeepseekMtpLayer(spec, parallel)

    # The parts `MtpDraft` computes with, by their names in this layout.
    embed = property(lambda self: self.mtp.embed_tokens)
    embedding_norm = property(lambda self: self.mtp.enorm)
    hidden_norm = property(lambda self: self.mtp.hnorm)
    projection = property(lambda self: self.mtp.eh_proj)
    layer = property(lambda self: self.mtp)
    final_norm = property(lambda self: self.mtp.shared_head.norm)
    matvec_weight = property(lambda self: self.mtp.shared_head.head.weight)


class DeepseekV2Recipe(DeepseekRecipe):
    architectures = ("DeepseekV2ForCausalLM",)


class DeepseekV3Recipe(DeepseekRecipe):
    architectures = ("DeepseekV3ForCausalLM",)
    v3 = True
