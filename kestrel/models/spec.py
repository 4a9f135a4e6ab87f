"""The decoder families' spec: `DecoderSpec` extends the core `ModelSpec` with the fields Llama,
Mistral, Qwen2/3, their MoE variants and the Qwen3-Next / Qwen3.5 hybrids read from their
configs, and declares each layer's `LayerSpec` from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kestrel.core.layer_spec import AttentionLayer, LayerSpec, RecurrentLayer
from kestrel.core.parallel import TensorParallel
from kestrel.core.recipe import ModelSpec
from kestrel.layers.rotary import RopeSpec

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"  # attention over the last `sliding_window` tokens only
LINEAR_ATTENTION = "linear_attention"
CHUNKED_ATTENTION = "chunked_attention"  # attention within chunks of `attention_chunk_size` (Llama 4)


@dataclass(frozen=True)
class MoeSpec:
    """Mixture-of-experts MLPs: how many experts, how many per token, and which layers."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # rescale the top-k weights to sum to one
    sparse_step: int = 1  # every sparse_step-th layer is sparse...
    dense_layers: tuple[int, ...] = ()  # ...except these

    def is_sparse(self, index: int) -> bool:
        return index not in self.dense_layers and (index + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers: key heads (shared by groups of value heads) and the conv kernel."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    grouped_projection: bool  # Qwen3-Next: one qkvz and one ba projection, grouped per key head

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    def for_rank(self, parallel: TensorParallel) -> LinearAttentionSpec:
        """The heads one tensor-parallel rank holds: its key heads and their value heads."""
        key_heads = parallel.split(self.num_key_heads, "linear_num_key_heads")
        value_heads = key_heads * (self.num_value_heads // self.num_key_heads)
        return dataclasses.replace(self, num_key_heads=key_heads, num_value_heads=value_heads)


@dataclass(frozen=True, kw_only=True)
class DecoderSpec(ModelSpec):
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    moe: MoeSpec | None = None
    shared_expert_size: int = 0  # MoE layers also run one always-on expert of this width
    # Hybrid stacks: each layer's kind; empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionSpec | None = None
    partial_rotary_factor: float = 1.0  # rotary embedding on this share of each head
    attention_output_gate: bool = False  # Qwen3-Next: sigmoid gate on the attention output
    attention_scale: float | None = None  # the scores' scale where not head_dim ** -0.5 (Gemma)
    local_rope: RopeSpec | None = None  # sliding-window layers' own rope, where it differs (Gemma 3)
    fused_projections: bool = False  # the checkpoint holds qkv_proj and gate_up_proj whole (Phi-3)
    attention_sinks: bool = False  # a learned logit per query head in each softmax (GPT-OSS)
    attention_chunk_size: int | None = None  # the chunked layers' chunk (Llama 4)

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", tuple(self._layer_spec(i) for i in range(self.num_layers)))

    def _layer_spec(self, index: int) -> LayerSpec:
        if self.layer_kind(index) == LINEAR_ATTENTION:
            linear = self.linear_attention
            return RecurrentLayer(
                linear.num_key_heads,
                linear.num_value_heads,
                linear.key_head_dim,
                linear.value_head_dim,
                linear.conv_kernel,
            )
        return AttentionLayer(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.window_of(index),
            scale=self.attention_scale,
            sinks=self.attention_sinks,
            chunk_size=self.attention_chunk_size if self.layer_kind(index) == CHUNKED_ATTENTION else None,
        )

    def window_of(self, index: int) -> int | None:
        """A layer's sliding window: every layer's where no kinds are listed (Mistral), else
        only the sliding layers' (Gemma 3)."""
        if not self.layer_types or self.layer_kind(index) == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def rope_of(self, index: int) -> RopeSpec:
        if self.local_rope is not None and self.layer_kind(index) == SLIDING_ATTENTION:
            return self.local_rope
        return self.rope

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(index)

    @property
    def stacks_shared_expert(self) -> bool:
        """Whether the shared expert has the routed experts' width, so it is stacked with them
        as one more expert that every token chooses (one fused MoE computes both)."""
        return self.moe is not None and self.shared_expert_size == self.moe.intermediate_size

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kind(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION

    def num_parameters(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings
