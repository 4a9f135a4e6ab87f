"""ModelRecipe: how one Hugging Face architecture maps onto Kestrel."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.recurrent_state import RecurrentStateSpec
from kestrel.core.state import KVCacheSpec
from kestrel.core.weight_bindings import WeightBindings

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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


@dataclass(frozen=True)
class ModelSpec:
    """An architecture's shape, resolved once from `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeSpec | None = None
    shared_expert_size: int = 0  # MoE layers also run one always-on expert of this width
    # Hybrid stacks: each layer's kind; empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionSpec | None = None
    partial_rotary_factor: float = 1.0  # rotary embedding on this share of each head
    attention_output_gate: bool = False  # Qwen3-Next: sigmoid gate on the attention output

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(index)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kind(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION

    def kind_index(self, index: int) -> int:
        """The layer's position among the layers of its kind: its index in its state pool."""
        kind = self.layer_kind(index)
        return sum(1 for i in range(index) if self.layer_kind(i) == kind)

    def num_layers_of(self, kind: str) -> int:
        return sum(1 for i in range(self.num_layers) if self.layer_kind(i) == kind)

    @property
    def is_hybrid(self) -> bool:
        return self.num_layers_of(LINEAR_ATTENTION) > 0

    def recurrent_state_spec(self, dtype: torch.dtype, parallel: TensorParallel = SINGLE) -> RecurrentStateSpec | None:
        """The recurrent state of one rank: its share of the linear-attention heads."""
        if self.linear_attention is None or not self.is_hybrid:
            return None
        linear = self.linear_attention.for_rank(parallel)
        return RecurrentStateSpec(
            num_layers=self.num_layers_of(LINEAR_ATTENTION),
            conv_channels=linear.conv_channels,
            conv_width=linear.conv_kernel - 1,
            num_heads=linear.num_value_heads,
            key_dim=linear.key_head_dim,
            value_dim=linear.value_head_dim,
            conv_dtype=dtype,
        )

    def kv_cache_spec(self, dtype: torch.dtype, page_size: int, parallel: TensorParallel = SINGLE) -> KVCacheSpec:
        """The KV pool of one rank: its share of the KV heads (replicated below one each)."""
        return KVCacheSpec(
            num_layers=self.num_layers_of(FULL_ATTENTION),
            num_kv_heads=parallel.head_slice(self.num_kv_heads, "num_key_value_heads")[1],
            head_dim=self.head_dim,
            dtype=dtype,
            page_size=page_size,
        )

    def num_parameters(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings


class CausalLM(Protocol):
    """What a recipe builds: hidden states from tokens, logits from hidden states."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


class ModelRecipe(Protocol):
    architectures: tuple[str, ...]

    def spec(self, hf_config: Any) -> ModelSpec:
        """Read the HF config into a `ModelSpec`; raise ValueError for unsupported variants."""
        ...

    def build(self, spec: ModelSpec, parallel: TensorParallel) -> nn.Module:
        """Build the module (this rank's shard of it); called under the meta device."""
        ...

    def bindings(self, model: nn.Module, spec: ModelSpec) -> WeightBindings:
        """How checkpoint tensor names map onto the module's parameters."""
        ...
