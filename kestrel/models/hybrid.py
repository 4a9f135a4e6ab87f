"""Hybrid decoders (Qwen3-Next, Qwen3.5 text): gated DeltaNet linear-attention layers
interleaved with gated full-attention layers.

The linear layers keep per-request state in a `RecurrentStateProvider` slot; the full
attention layers use the paged KV pool like any decoder. Norms are Gemma-style (the
weight is stored as an offset from one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.forward import ForwardContext
from kestrel.core.metadata import RecurrentMetadata
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.recurrent_state import RecurrentLayerState
from kestrel.core.weight_bindings import PackedMapping, SkippedPrefix, WeightBindingError, WeightBindings
from kestrel.layers import ops
from kestrel.layers.gated_delta import (
    causal_conv,
    causal_conv_step,
    chunked_gated_delta,
    l2_normalize,
    recurrent_gated_delta,
)
from kestrel.layers.gated_delta_kernels import (
    FLA_CHUNK,
    causal_conv_varlen,
    gated_delta_chunked,
    gated_delta_varlen,
    takes_chunked,
)
from kestrel.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSlice, copy_into
from kestrel.layers.moe import SparseMoe
from kestrel.layers.norm import OffsetRMSNorm, RMSNorm
from kestrel.models.dense import (
    DecoderForCausalLM,
    DecoderMLP,
    ResidualBlock,
    attention_layer_spec,
    attention_shards,
    sparse_moe_args,
)
from kestrel.models.spec import LINEAR_ATTENTION, DecoderSpec, LinearAttentionSpec


class GatedRMSNorm(RMSNorm):
    """norm(x) * weight * silu(gate), per value head."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass(frozen=True)
class DeltaNetShard:
    """The key heads (and the value heads grouped under them) one rank holds, and how to
    cut them out of checkpoint tensors laid out over all heads."""

    full: LinearAttentionSpec
    local: LinearAttentionSpec
    first_key_head: int

    @classmethod
    def of(cls, linear: LinearAttentionSpec, parallel: TensorParallel) -> DeltaNetShard:
        local = linear.for_rank(parallel)
        return cls(linear, local, parallel.rank * local.num_key_heads)

    @property
    def first_value_head(self) -> int:
        return self.first_key_head * (self.full.num_value_heads // self.full.num_key_heads)

    def qkv_rows(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's rows of a [q | k | v] tensor (the projection, or the conv weight)."""
        full, local = self.full, self.local
        _expect_rows(tensor, full.conv_channels, what)
        q, k, v = tensor.split((full.key_size, full.key_size, full.value_size))
        key_start = self.first_key_head * full.key_head_dim
        return torch.cat(
            (
                q.narrow(0, key_start, local.key_size),
                k.narrow(0, key_start, local.key_size),
                v.narrow(0, self.first_value_head * full.value_head_dim, local.value_size),
            )
        )

    def value_rows(self, tensor: torch.Tensor, width: int, what: str) -> torch.Tensor:
        """This rank's rows of a tensor with `width` rows per value head."""
        _expect_rows(tensor, self.full.num_value_heads * width, what)
        return tensor.narrow(0, self.first_value_head * width, self.local.num_value_heads * width)

    def regroup(self, tensor: torch.Tensor, parts: tuple[int, ...], what: str) -> torch.Tensor:
        """Qwen3-Next's grouped layout (per key head: its parts in turn) -> this rank's key
        heads, each part gathered over them: [part 0 of every head | part 1 | ...]."""
        _expect_rows(tensor, self.full.num_key_heads * sum(parts), what)
        groups = tensor.view(self.full.num_key_heads, sum(parts), -1).narrow(
            0, self.first_key_head, self.local.num_key_heads
        )
        return torch.cat([part.reshape(-1, tensor.shape[-1]) for part in groups.split(parts, dim=1)])


def _expect_rows(tensor: torch.Tensor, rows: int, what: str) -> None:
    if tensor.shape[0] != rows:
        raise WeightBindingError(f"shape mismatch for {what}: expected {rows} rows, got {tuple(tensor.shape)}")


class LinearAttentionProjection(ColumnParallelLinear):
    """Every input projection of a DeltaNet layer in one matmul: [q k v | z | b | a], for
    this rank's heads.

    Qwen3.5 checkpoints hold qkv, z, b and a; Qwen3-Next ones two projections grouped per
    key head (qkvz, then ba). Both are cut and regrouped at load time into this layout, so
    both families run the same forward.
    """

    def __init__(self, hidden_size: int, shard: DeltaNetShard) -> None:
        local = shard.local
        sizes = {"qkv": local.conv_channels, "z": local.value_size, "b": local.num_value_heads}
        sizes["a"] = local.num_value_heads
        super().__init__(hidden_size, {name: ShardSlice.whole(size) for name, size in sizes.items()})
        self.shard = shard

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({"qkvz", "ba"}) if self.shard.full.grouped_projection else super().shard_ids()

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        if shard_id not in self.shard_ids():
            raise WeightBindingError(f"no shard {shard_id!r} in a linear-attention projection")
        full, shard = self.shard.full, self.shard
        group = full.num_value_heads // full.num_key_heads
        value_width = group * full.value_head_dim
        rows = {
            "qkvz": lambda: shard.regroup(
                tensor, (full.key_head_dim, full.key_head_dim, value_width, value_width), "qkvz"
            ),
            "ba": lambda: shard.regroup(tensor, (group, group), "ba"),
            "qkv": lambda: shard.qkv_rows(tensor, "qkv"),
            "z": lambda: shard.value_rows(tensor, full.value_head_dim, "z"),
            "b": lambda: shard.value_rows(tensor, 1, "b"),
            "a": lambda: shard.value_rows(tensor, 1, "a"),
        }[shard_id]()
        first = "b" if shard_id == "ba" else "qkv" if shard_id == "qkvz" else shard_id
        param.data.narrow(0, self._offsets[first], rows.shape[0]).copy_(rows)


class DeltaNetConv(nn.Module):
    """The depthwise convolution's weight [channels, 1, kernel] for this rank's channels."""

    def __init__(self, shard: DeltaNetShard) -> None:
        super().__init__()
        self.shard = shard
        self.weight = nn.Parameter(
            torch.empty(shard.local.conv_channels, 1, shard.full.conv_kernel), requires_grad=False
        )

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        copy_into(param.data, self.shard.qkv_rows(tensor, "conv1d"), "conv1d")


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: DecoderSpec, state_index: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.shard = DeltaNetShard.of(spec.linear_attention, parallel)
        linear = self.linear = self.shard.local
        self.state_index = state_index
        self.in_proj = LinearAttentionProjection(spec.hidden_size, self.shard)
        self.conv1d = DeltaNetConv(self.shard)
        self.dt_bias = nn.Parameter(torch.empty(linear.num_value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(linear.num_value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(linear.value_head_dim, spec.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.shard.full.value_size, spec.hidden_size, parallel)

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        """dt_bias and A_log: one value per value head."""
        copy_into(param.data, self.shard.value_rows(tensor, 1, "per-head parameter"), "per-head parameter")

    def forward(
        self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], context: ForwardContext
    ) -> torch.Tensor:
        mixed, gate, b, a = self.in_proj.split(self.in_proj(hidden))
        state, meta = context.recurrent_state(self.state_index)
        mix = self.mix_with_kernels if ops.runs_kernels(hidden) else self.mix_with_torch
        out = mix(mixed, a, b, state, meta)
        out = self.norm(out, gate.reshape(out.shape))
        return self.out_proj(out.reshape(hidden.shape[0], self.linear.value_size))

    def mix_with_kernels(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state: RecurrentLayerState, meta: RecurrentMetadata
    ) -> torch.Tensor:
        """Convolution and recurrence over the whole step in two Triton launches
        (gated_delta_kernels.py). Returns [tokens, value heads, value_dim] in mixed's dtype."""
        weight = self.conv1d.weight[:, 0, :]
        convolved = causal_conv_varlen(
            mixed,
            state.conv,
            weight,
            meta.query_start,
            meta.slots,
            meta.has_state_tensor,
            meta.read_slots,
            meta.save_slots,
        )
        first_prefill_row = meta.query_start_loc[meta.num_decodes]
        if not takes_chunked(convolved, convolved.shape[0] - first_prefill_row):
            return self._recurrence(convolved, a, b, state, meta, slice(0, len(meta.slot_ids)))
        # Decode rows one token at a time, prefill rows in chunks of tokens (tensor cores).
        out = torch.empty(
            (convolved.shape[0], self.linear.num_value_heads, self.linear.value_head_dim),
            dtype=convolved.dtype,
            device=convolved.device,
        )
        decodes = slice(0, meta.num_decodes)
        if meta.num_decodes:
            out[:first_prefill_row] = self._recurrence(convolved, a, b, state, meta, decodes)
        prefills = slice(meta.num_decodes, len(meta.slot_ids))
        rows = slice(first_prefill_row, None)
        out[rows] = gated_delta_chunked(
            convolved[rows],
            a[rows],
            b[rows],
            self.A_log,
            self.dt_bias,
            state.recurrent,
            meta.prefill_chunks(FLA_CHUNK),
            meta.slots[prefills],
            meta.has_state_tensor[prefills],
            self.linear.num_key_heads,
            meta.read_slots[prefills],
            meta.save_slots[prefills],
        )
        return out

    def _recurrence(
        self,
        convolved: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        state: RecurrentLayerState,
        meta: RecurrentMetadata,
        sequences: slice,
    ) -> torch.Tensor:
        """The token-by-token kernel over the sequences `sequences` (from the first: their
        rows start at row 0)."""
        end = meta.query_start_loc[sequences.stop]
        return gated_delta_varlen(
            convolved[:end],
            a[:end],
            b[:end],
            self.A_log,
            self.dt_bias,
            state.recurrent,
            meta.query_start[: sequences.stop + 1],
            meta.slots[sequences],
            meta.has_state_tensor[sequences],
            self.linear.num_key_heads,
            meta.read_slots[sequences],
            meta.save_slots[sequences],
        )

    def mix_with_torch(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state: RecurrentLayerState, meta: RecurrentMetadata
    ) -> torch.Tensor:
        """The reference (and CPU) path: torch ops, decodes batched, each prefill on its own."""
        linear, tokens = self.linear, mixed.shape[0]
        mixed = self._convolve(mixed, state, meta)
        query, key, value = mixed.split((linear.key_size, linear.key_size, linear.value_size), dim=-1)
        group = linear.num_value_heads // linear.num_key_heads
        query = l2_normalize(query.float().view(tokens, linear.num_key_heads, -1)) * linear.key_head_dim**-0.5
        key = l2_normalize(key.float().view(tokens, linear.num_key_heads, -1))
        query, key = query.repeat_interleave(group, dim=1), key.repeat_interleave(group, dim=1)
        value = value.float().view(tokens, linear.num_value_heads, -1)
        beta = b.float().sigmoid()
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return self._delta(query, key, value, log_decay, beta, state, meta).to(mixed.dtype)

    def _convolve(self, mixed: torch.Tensor, state: RecurrentLayerState, meta: RecurrentMetadata) -> torch.Tensor:
        weight = self.conv1d.weight[:, 0, :]
        out = torch.empty_like(mixed)
        decodes = meta.num_decodes
        if decodes:
            prior = _zero_unless(state.conv[meta.read_slots[:decodes]], meta.has_state_tensor[:decodes])
            out[:decodes], new_prior = causal_conv_step(mixed[:decodes], prior, weight)
            _save(state.conv, new_prior, meta, slice(0, decodes))
        for index in range(decodes, len(meta.slot_ids)):
            rows = slice(meta.query_start_loc[index], meta.query_start_loc[index + 1])
            prior = _starting(state.conv, meta, index)
            out[rows], new_prior = causal_conv(mixed[rows], prior, weight)
            _save(state.conv, new_prior[None], meta, slice(index, index + 1))
        return out

    def _delta(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        log_decay: torch.Tensor,
        beta: torch.Tensor,
        state: RecurrentLayerState,
        meta: RecurrentMetadata,
    ) -> torch.Tensor:
        out = torch.empty_like(value)
        decodes = meta.num_decodes
        if decodes:
            rows = slice(0, decodes)
            prior = _zero_unless(state.recurrent[meta.read_slots[:decodes]], meta.has_state_tensor[:decodes])
            out[rows], new_state = recurrent_gated_delta(
                query[rows], key[rows], value[rows], log_decay[rows], beta[rows], _in_float32(prior)
            )
            _save(state.recurrent, new_state, meta, rows)
        for index in range(decodes, len(meta.slot_ids)):
            rows = slice(meta.query_start_loc[index], meta.query_start_loc[index + 1])
            prior = _starting(state.recurrent, meta, index)
            out[rows], new_state = chunked_gated_delta(
                query[rows], key[rows], value[rows], log_decay[rows], beta[rows], _in_float32(prior)
            )
            _save(state.recurrent, new_state[None], meta, slice(index, index + 1))
        return out


def _starting(states: torch.Tensor, meta: RecurrentMetadata, index: int) -> torch.Tensor:
    """Sequence `index`'s starting state: its read slot's, or zeros for a fresh sequence."""
    read = meta.read_ids[index]
    return states[read] if meta.has_state[index] else torch.zeros_like(states[read])


def _in_float32(state: torch.Tensor) -> torch.Tensor:
    """A stored recurrent state (float32, or a half-precision `mamba_ssm_cache_dtype`) as the
    recurrence computes it; saving rounds it back to the pool's dtype."""
    return state.float()


def _save(states: torch.Tensor, new: torch.Tensor, meta: RecurrentMetadata, sequences: slice) -> None:
    """The sequences' final states into their slots, and into their save slots where any
    differs (a snapshot the prefix cache keeps), in the pool's dtype."""
    new = new.to(states.dtype)
    states[meta.slots[sequences]] = new
    # A compiled step cannot read its ids on the host (they change between replays): it
    # writes the save slots always (the slot again where they are the same).
    if torch.compiler.is_compiling() or meta.save_ids[sequences] != meta.slot_ids[sequences]:
        states[meta.save_slots[sequences]] = new


def _zero_unless(states: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero the states of sequences that start fresh (their slot may hold a previous owner's)."""
    return torch.where(keep.view(-1, *([1] * (states.dim() - 1))), states, states.new_zeros(()))


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, Gemma-style q/k norms and partial rotary."""

    def __init__(self, spec: DecoderSpec, kv_index: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.layer_spec = attention_layer_spec(spec, parallel)
        # Each head's rows hold its query, then its gate: two head widths per query head.
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, attention_shards(spec, parallel, q_width=2))
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, parallel)
        self.q_norm = OffsetRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], context: ForwardContext
    ) -> torch.Tensor:
        spec, tokens = self.layer_spec, hidden.shape[0]
        query_gate, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        # Each head's projection holds its query, then its gate.
        query, gate = query_gate.view(tokens, spec.num_heads, 2 * spec.head_dim).chunk(2, dim=-1)
        query = self.q_norm.rotated(query, *rotary)
        key = self.k_norm.rotated(key.view(tokens, spec.num_kv_heads, spec.head_dim), *rotary)
        value = value.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        attended = context.attend(self.kv_index, query, key, value, spec)
        gated = ops.sigmoid_gate(attended.reshape(tokens, spec.num_heads, spec.head_dim), gate)
        return self.o_proj(gated.view(tokens, -1))


class SharedExpertMoe(SparseMoe):
    """Routed experts plus one always-on expert scaled by a learned sigmoid gate.

    Where the shared expert has the routed experts' width (Qwen3-Next, Qwen3.5-MoE) it is
    stacked after them as expert `num_experts`, which every token chooses with its gate as
    the weight: one fused MoE computes both, with no separate matmuls for the shared expert.
    The shared expert's gate is one more row of the router (checkpoint shard "shared" of
    `gate`), so one matvec gives every logit.
    """

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        stacked = spec.stacks_shared_expert
        args = sparse_moe_args(spec)
        super().__init__(*args, parallel, num_stacked=spec.moe.num_experts + 1 if stacked else None)
        if not stacked:
            self.shared_expert = DecoderMLP(spec, parallel, spec.shared_expert_size)
        rows = {None: ShardSlice.whole(self.num_experts), "shared": ShardSlice.whole(1)}
        self.gate = ColumnParallelLinear(spec.hidden_size, rows, quantizable=False)  # replicated

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        stacked = self.num_stacked > self.num_experts
        if stacked and ops.takes_gemv(hidden, self.gate.use_gemv):
            return self.mix_experts(hidden, *self.route_in_matvec(hidden, self.gate.weight, gated_shared=1))
        logits = self.gate(hidden)
        routed, shared_logits = logits[:, : self.num_experts], logits[:, self.num_experts :]
        if not stacked:
            mixed = self.mix_experts(hidden, *self.pick(routed, hidden.dtype))
            return mixed + torch.sigmoid(shared_logits) * self.shared_expert(hidden)
        return self.mix_experts(hidden, *self.pick(routed, hidden.dtype, shared_logits))

    def route(
        self, hidden: torch.Tensor, shared_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' choices (the router's rows before the shared gate's)."""
        if shared_logits is None and ops.takes_gemv(hidden, self.gate.use_gemv):
            return self.route_in_matvec(hidden, self.gate.weight[: self.num_experts])
        return self.pick(self.gate(hidden)[:, : self.num_experts], hidden.dtype, shared_logits)


class HybridDecoderLayer(ResidualBlock):
    def __init__(self, spec: DecoderSpec, index: int, parallel: TensorParallel) -> None:
        super().__init__(spec, OffsetRMSNorm)
        self.is_linear = spec.layer_kind(index) == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(spec, spec.group_index(index), parallel)
        else:
            self.self_attn = GatedAttention(spec, spec.group_index(index), parallel)
        if spec.is_moe_layer(index) and spec.shared_expert_size:
            self.mlp = SharedExpertMoe(spec, parallel)
        elif spec.is_moe_layer(index):
            self.mlp = SparseMoe(*sparse_moe_args(spec), parallel)
        else:
            self.mlp = DecoderMLP(spec, parallel)

    def mix(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], context: ForwardContext):
        mixer = self.linear_attn if self.is_linear else self.self_attn
        return mixer(hidden, rotary, context)

    def folds(self, hidden: torch.Tensor) -> bool:
        # Folded, a Qwen3-Next step of one row took 2.3-3.6% longer (1.154-1.167 ms against
        # 1.126-1.129 on an H100, 12 layers, three pairs), where other layers gained up to 2.9%.
        return False


class HybridForCausalLM(DecoderForCausalLM):
    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__(spec, parallel, HybridDecoderLayer, OffsetRMSNorm)


HYBRID_MAPPINGS = (
    PackedMapping("in_proj_qkvz", "in_proj", "qkvz"),
    PackedMapping("in_proj_ba", "in_proj", "ba"),
    PackedMapping("in_proj_qkv", "in_proj", "qkv"),
    PackedMapping("in_proj_z", "in_proj", "z"),
    PackedMapping("in_proj_b", "in_proj", "b"),
    PackedMapping("in_proj_a", "in_proj", "a"),
)


# Qwen3-Next and Qwen3.5 releases carry multi-token-prediction heads; transformers skips them too.
MTP_HEADS = SkippedPrefix("mtp.", "multi-token prediction heads, unused until speculative decoding takes them")


def hybrid_bindings(
    model: nn.Module,
    spec: DecoderSpec,
    extra: tuple[PackedMapping, ...] = (),
    skipped: tuple[SkippedPrefix, ...] = (),
    renamed_prefixes: dict[str, str] | None = None,
) -> WeightBindings:
    from kestrel.models.dense import decoder_bindings

    return decoder_bindings(model, spec, extra + HYBRID_MAPPINGS, (MTP_HEADS, *skipped), renamed_prefixes)
