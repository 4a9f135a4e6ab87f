"""The dense decoder shared by Llama, Mistral, Qwen2 and Qwen3: their differences are spec fields."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.forward import ForwardContext
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import PackedMapping, SkippedPrefix, WeightBindings
from kestrel.layers import ops
from kestrel.layers.embedding import VocabParallelEmbedding, vocab_rows
from kestrel.layers.linear import ColumnParallelLinear, FusedColumnLinear, RowParallelLinear, ShardSlice
from kestrel.layers.moe import SparseMoe
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RopeSpec, rotary_cos_sin
from kestrel.models.spec import DecoderSpec

ATTENTION_MAPPINGS = (
    PackedMapping("q_proj", "qkv_proj", "q"),
    PackedMapping("k_proj", "qkv_proj", "k"),
    PackedMapping("v_proj", "qkv_proj", "v"),
)
MLP_MAPPINGS = (
    PackedMapping("gate_proj", "gate_up_proj", "gate"),
    PackedMapping("up_proj", "gate_up_proj", "up"),
)
PACKED_MAPPINGS = ATTENTION_MAPPINGS + MLP_MAPPINGS

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rank_slice(parallel: TensorParallel, total: int, what: str) -> ShardSlice:
    """This rank's equal share of `total` rows."""
    part = parallel.split(total, what)
    return ShardSlice(parallel.rank * part, part, total)


def attention_shards(spec: DecoderSpec, parallel: TensorParallel, q_width: int = 1) -> dict[str, ShardSlice]:
    """The rows of q, k and v this rank holds: its query heads, and its KV heads (replicated
    when there are fewer KV heads than ranks). `q_width` heads' worth of rows per query head
    (2 when each head's projection also holds an output gate)."""
    head_dim = spec.head_dim
    q = rank_slice(parallel, spec.num_heads * head_dim * q_width, "num_attention_heads")
    first, count = parallel.head_slice(spec.num_kv_heads, "num_key_value_heads")
    kv = ShardSlice(first * head_dim, count * head_dim, spec.num_kv_heads * head_dim)
    return {"q": q, "k": kv, "v": kv}


def attention_layer_spec(spec: DecoderSpec, parallel: TensorParallel, index: int | None = None) -> AttentionLayerSpec:
    """What attention layer `index` (by default the first) asks of its backend on this rank."""
    layer = spec.attention_layers()[0] if index is None else spec.layers[index]
    return layer.for_rank(parallel)


def column_linear(spec: DecoderSpec) -> type[ColumnParallelLinear]:
    """The class of a stacked projection: one checkpoint tensor per part, or all in one."""
    return FusedColumnLinear if spec.fused_projections else ColumnParallelLinear


class DecoderAttention(nn.Module):
    def __init__(
        self, spec: DecoderSpec, layer_index: int, parallel: TensorParallel, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.layer_spec = attention_layer_spec(spec, parallel, layer_index)
        shards = attention_shards(spec, parallel)
        self.qkv_proj = column_linear(spec)(spec.hidden_size, shards, bias=spec.attention_bias)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, parallel)
        self.q_norm = norm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = norm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.sinks: torch.Tensor | None = None  # per query head, where the family has them (GPT-OSS)

    def folds(self, hidden: torch.Tensor) -> bool:
        """Whether a one-row `hidden` takes matvecs that fold the input norm and the residual
        add (`forward`'s `norm` and `residual`)."""
        return self.qkv_proj.folds(hidden) and self.o_proj.folds(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
        norm: ops.RowNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over norm(hidden) (with `norm`; else hidden as given), plus `residual`."""
        spec = self.layer_spec
        tokens = hidden.shape[0]
        cos, sin = rotary
        if self.q_norm is None:
            # q and k sit side by side in each row of qkv: one rotary pass for both, inside
            # the projection's own kernel where it can be.
            rotation = ops.HeadRotation(cos, sin, spec.num_heads + spec.num_kv_heads, spec.head_dim)
            qkv_proj = self.qkv_proj
            qkv = ops.linear_rotary(hidden, qkv_proj.weight, qkv_proj.bias, rotation, qkv_proj.use_gemv, norm)
            query, key, value = self.qkv_proj.split(qkv)
            query = query.view(tokens, spec.num_heads, spec.head_dim)
            key = key.view(tokens, spec.num_kv_heads, spec.head_dim)
        else:
            qkv = self.qkv_proj(hidden, norm)
            query, key, value = self.qkv_proj.split(qkv)
            query, key = ops.qk_norm_rotary(
                query.view(tokens, spec.num_heads, spec.head_dim),
                key.view(tokens, spec.num_kv_heads, spec.head_dim),
                self.q_norm.effective_weight,
                self.k_norm.effective_weight,
                self.q_norm.eps,
                cos,
                sin,
            )
        value = value.view(tokens, spec.num_kv_heads, spec.head_dim)
        attended = context.attend(self.layer_index, query, key, value, spec, sinks=self.sinks)
        return self.o_proj(attended.reshape(tokens, spec.num_heads * spec.head_dim), residual)


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec, parallel: TensorParallel, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or spec.intermediate_size
        rows = rank_slice(parallel, width, "intermediate_size")
        self.gate_up_proj = column_linear(spec)(spec.hidden_size, {"gate": rows, "up": rows})
        self.down_proj = RowParallelLinear(width, spec.hidden_size, parallel)
        if spec.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {spec.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[spec.hidden_act]
        self.fused_silu = spec.hidden_act == "silu"

    def folds(self, hidden: torch.Tensor) -> bool:
        """Whether a one-row `hidden` takes matvecs that fold the norm and the residual add."""
        return self.fused_silu and self.gate_up_proj.folds(hidden) and self.down_proj.folds(hidden)

    def forward(
        self, hidden: torch.Tensor, norm: ops.RowNorm | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MLP of norm(hidden) (with `norm`; else of hidden as given), plus `residual`."""
        if self.fused_silu:
            gate_up = self.gate_up_proj
            activated = ops.linear_silu_and_mul(hidden, gate_up.weight, gate_up.use_gemv, norm)
            return self.down_proj(activated, residual)
        if norm is not None:
            hidden = ops.rms_norm(hidden, norm.weight, norm.eps)
        gate_up = self.gate_up_proj(hidden)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate.contiguous()).mul_(up), residual)


class ResidualBlock(nn.Module):
    """norm -> token mixer -> norm -> MLP, with the residual stream carried between layers.
    A subclass provides the mixer (`self_attn`, or its own `mixer`) and the MLP (`mlp`).

    Both are called with an optional `norm` (an ops.RowNorm to apply to their input first)
    and `residual` (to add to their output), and say with `folds(hidden)` whether their
    matvecs do both inside their own launches for this input."""

    def __init__(self, spec: DecoderSpec, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.input_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The token mixer (attention, linear attention)."""
        return self.self_attn

    def mix(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
        norm: ops.RowNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.mixer(hidden, rotary, context, norm, residual)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it), or, where
        the layer folds its norms (`folds`), (the residual stream after this layer, None).

        Each residual add happens inside the next norm, so it costs no pass of its own; or,
        folded, inside the matvec that writes the layer's output.
        """
        if self.folds(hidden):
            stream = hidden if residual is None else hidden + residual
            return self.forward_folded(stream, rotary, context), None
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mix(hidden, rotary, context)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def folds(self, hidden: torch.Tensor) -> bool:
        """Whether this step runs `forward_folded`: where the mixer and the MLP both fold (one
        row through matvecs only), which saves both norms' launches."""
        return self.mixer.folds(hidden) and self.mlp.folds(hidden)

    def forward_folded(
        self, stream: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], context: ForwardContext
    ) -> torch.Tensor:
        """The residual stream after this layer, from the stream before it: each norm inside
        the matvecs that read its output, each residual add inside the matvec that writes
        the sum."""
        stream = self.mix(stream, rotary, context, self.input_layernorm.row_norm(), residual=stream)
        return self.mlp(stream, self.post_attention_layernorm.row_norm(), residual=stream)


class DecoderLayer(ResidualBlock):
    def __init__(self, spec: DecoderSpec, layer_index: int, parallel: TensorParallel) -> None:
        super().__init__(spec)
        self.self_attn = DecoderAttention(spec, layer_index, parallel)
        if spec.is_moe_layer(layer_index):
            self.mlp = SparseMoe(*sparse_moe_args(spec), parallel)
        else:
            self.mlp = DecoderMLP(spec, parallel)


class DecoderModel(nn.Module):
    def __init__(
        self, spec: DecoderSpec, parallel: TensorParallel, layer: type[ResidualBlock], norm: type[RMSNorm]
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, parallel)
        self.layers = nn.ModuleList(layer(spec, i, parallel) for i in range(spec.num_layers))
        self.norm = norm(spec.hidden_size, spec.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        parallel: TensorParallel = SINGLE,
        layer: type[ResidualBlock] = DecoderLayer,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.spec, self.parallel = spec, parallel
        self.model = DecoderModel(spec, parallel, layer, norm)
        # The LM head holds the same vocabulary block as the embedding (tied or not).
        rows = {None: vocab_rows(spec.vocab_size, parallel)}
        self.lm_head = (
            None if spec.tie_word_embeddings else ColumnParallelLinear(spec.hidden_size, rows, quantizable=False)
        )

    use_gemv = False  # for the LM head, as `Linear.use_gemv`

    @property
    def matvec_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding's when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        rotary = rotary_cos_sin(positions, self.spec.rope, self.spec.rotary_dim, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, rotary, context)
        return self.model.norm.of_stream(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.parallel.all_gather_columns(ops.linear(hidden, self.matvec_weight, use_gemv=self.use_gemv))
        return logits[:, : self.spec.vocab_size].float()


def sparse_moe_args(spec: DecoderSpec) -> tuple[int, int, int, int, bool]:
    moe = spec.moe
    return spec.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize


def decoder_bindings(
    model: nn.Module,
    spec: DecoderSpec,
    extra: tuple[PackedMapping, ...] = (),
    skipped: tuple[SkippedPrefix, ...] = (),
    renamed_prefixes: dict[str, str] | None = None,
    mappings: tuple[PackedMapping, ...] = PACKED_MAPPINGS,
) -> WeightBindings:
    """`mappings`: the checkpoint projections stacked into one layer (q, k, v; gate, up)."""
    # A tied checkpoint may still carry lm_head.weight (a copy of the embeddings): skip it.
    ignored = ("lm_head.weight",) if spec.tie_word_embeddings else ()
    return WeightBindings(model, extra + mappings, ignored, skipped, renamed_prefixes)


def read_rope(hf_config: object, allow_partial: bool = False) -> RopeSpec:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    max_position = getattr(hf_config, "max_position_embeddings", None)
    if getattr(hf_config, "original_max_position_embeddings", None) is not None:
        params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    return rope_from_parameters(params, getattr(hf_config, "rope_theta", 10000.0), allow_partial, max_position)


def rope_from_parameters(
    params: dict, default_theta: float, allow_partial: bool = False, max_position: int | None = None
) -> RopeSpec:
    """A RopeSpec from transformers' rope parameters (`rope_type`, `rope_theta`, scaling fields)."""
    theta = params.get("rope_theta", default_theta)
    scaling = params.get("rope_type", params.get("type", "default"))
    if scaling not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise ValueError(f"unsupported rope scaling {scaling!r}; supported: default, linear, llama3, yarn, longrope")
    if params.get("partial_rotary_factor", 1.0) != 1.0 and not allow_partial:
        raise ValueError("partial rotary embeddings are not supported by the dense decoder")
    if scaling == "longrope":
        return longrope(params, float(theta), max_position)
    if scaling == "yarn":
        return yarn(params, float(theta), max_position)
    return RopeSpec(
        theta=float(theta),
        scaling=scaling,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def pretraining_growth(params: dict, max_position: int | None) -> tuple[int, float]:
    """The pretraining length, and the scaling factor: as given, else the context's growth
    over that length (transformers' rule for LongRoPE and YaRN alike)."""
    original = int(params["original_max_position_embeddings"])
    return original, params.get("factor") or (max_position or original) / original


def longrope(params: dict, theta: float, max_position: int | None) -> RopeSpec:
    """LongRoPE as transformers computes it: the factor is the context's growth over the
    pretraining length unless given, and cos and sin scale by sqrt(1 + ln(factor) / ln(that
    length)) unless an attention factor is given."""
    original, factor = pretraining_growth(params, max_position)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec(
        theta=theta,
        scaling="longrope",
        factor=float(factor),
        original_max_position=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention_factor),
    )


def yarn(params: dict, theta: float, max_position: int | None) -> RopeSpec:
    """YaRN as transformers reads it: the factor unless absent (then the context's growth over
    the pretraining length), the attention factor from mscale where DeepSeek's configs give one."""
    original, factor = pretraining_growth(params, max_position)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return RopeSpec(
        theta=theta,
        scaling="yarn",
        factor=float(factor),
        original_max_position=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )


def eos_ids(hf_config: object) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def read_dense_spec(hf_config: object, architecture: str, **family: object) -> DecoderSpec:
    """The fields every dense decoder shares; `family` sets what differs (bias, qk norm, window)."""
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    fields = dict(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope=family.pop("rope", None) or read_rope(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        hidden_act=getattr(hf_config, "hidden_act", "silu"),
        eos_token_ids=eos_ids(hf_config),
    )
    fields.update(family)
    return DecoderSpec(**fields)


def reject_sliding_window_layers(hf_config: object, family: str) -> None:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{family} with use_sliding_window=true is not supported yet")


class DenseDecoderRecipe:
    """The recipe every dense decoder family shares; a family only says how to read its config."""

    architectures: tuple[str, ...] = ()

    def spec(self, hf_config: object) -> DecoderSpec:
        raise NotImplementedError

    def build(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return DecoderForCausalLM(spec, parallel)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return decoder_bindings(model, spec)
