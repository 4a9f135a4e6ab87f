"""Per-layer specs: what each layer of a model is, as the engine sees it, and the state group
that keeps its per-request state.

A recipe declares one `LayerSpec` per layer. Layers that name the same state group share one
pool; `ModelSpec.state_groups` gathers them into one `StateGroupSpec` per group, and the
composition root builds one provider per group from it. A new kind of layer (MLA latents, a
sliding-window group with its own smaller pool) is a new `LayerSpec` and `StateGroupSpec`:
nothing in the planner, the runner or this package changes.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.batch import KV_GROUP
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.recurrent_state import RECURRENT_GROUP, RecurrentStateProvider, RecurrentStateSpec
from kestrel.core.state import KVCacheSpec, KVLayout, PagedKVProvider, StateProvider


@dataclass(frozen=True)
class PoolBudget:
    """What a group's pool may take: paged pools share a byte budget; pools of one unit per
    sequence hold one per sequence that may run at once."""

    bytes: int
    max_num_seqs: int
    device: torch.device
    enable_prefix_caching: bool = False
    kv_layout: KVLayout | None = None
    num_snapshots: int = 0  # copies of a fixed-size state the prefix cache may keep


class StateGroupSpec(Protocol):
    """The pool one state group needs, for one tensor-parallel rank."""

    paged: bool  # sized from the byte budget (True) or one unit per sequence (False)

    def bytes_per_unit(self) -> int: ...

    def build(self, budget: PoolBudget) -> StateProvider: ...


class LayerSpec(ABC):
    state_group: str

    @abstractmethod
    def group_spec(
        self, num_layers: int, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, parallel: TensorParallel
    ) -> StateGroupSpec:
        """The state group's spec for `num_layers` layers like this one on one rank (`dtype`:
        the model's; `kv_dtype`: what a KV pool stores)."""


@dataclass(frozen=True)
class PagedKVGroup:
    kv: KVCacheSpec
    paged = True

    def bytes_per_unit(self) -> int:
        return self.kv.bytes_per_page()

    def build(self, budget: PoolBudget) -> PagedKVProvider:
        return PagedKVProvider(self.kv, budget.bytes, budget.device, budget.enable_prefix_caching, budget.kv_layout)


@dataclass(frozen=True)
class RecurrentGroup:
    recurrent: RecurrentStateSpec
    paged = False

    def bytes_per_unit(self) -> int:
        return self.recurrent.bytes_per_slot()

    def build(self, budget: PoolBudget) -> RecurrentStateProvider:
        return RecurrentStateProvider(self.recurrent, budget.max_num_seqs, budget.device, budget.num_snapshots)


@dataclass(frozen=True)
class AttentionLayer(LayerSpec):
    """Full attention over a paged KV pool, or sliding-window attention over the last N tokens."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    state_group: str = KV_GROUP
    scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    sinks: bool = False  # a learned logit per query head in each softmax (GPT-OSS)
    chunk_size: int | None = None  # chunked local attention (Llama 4): within chunks of this size
    latent_dim: int | None = None  # MLA: keys are latents of this width + rotary dims, values the latents

    def for_rank(self, parallel: TensorParallel = SINGLE) -> AttentionLayerSpec:
        """The heads one rank computes: its query heads, its KV heads (replicated below one each)."""
        return AttentionLayerSpec(
            num_heads=parallel.split(self.num_heads, "num_attention_heads"),
            num_kv_heads=parallel.head_slice(self.num_kv_heads, "num_key_value_heads")[1],
            head_dim=self.head_dim,
            scale=self.scale if self.scale is not None else self.head_dim**-0.5,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
            chunk_size=self.chunk_size,
            latent_dim=self.latent_dim,
        )

    def group_spec(
        self, num_layers: int, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, parallel: TensorParallel
    ) -> StateGroupSpec:
        kv_heads = self.for_rank(parallel).num_kv_heads
        return PagedKVGroup(KVCacheSpec(num_layers, kv_heads, self.head_dim, kv_dtype, page_size, self.latent_dim))


@dataclass(frozen=True)
class RecurrentLayer(LayerSpec):
    """A linear-attention (gated DeltaNet) layer: a causal convolution and a recurrent matrix
    per value head, both of fixed size per sequence. Key heads are shared by groups of value
    heads, and a rank holds whole groups."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    state_group: str = RECURRENT_GROUP

    def for_rank(self, parallel: TensorParallel = SINGLE) -> RecurrentLayer:
        key_heads = parallel.split(self.num_key_heads, "linear_num_key_heads")
        value_heads = key_heads * (self.num_value_heads // self.num_key_heads)
        return dataclasses.replace(self, num_key_heads=key_heads, num_value_heads=value_heads)

    def group_spec(
        self, num_layers: int, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, parallel: TensorParallel
    ) -> StateGroupSpec:
        mine = self.for_rank(parallel)
        channels = 2 * mine.num_key_heads * mine.key_head_dim + mine.num_value_heads * mine.value_head_dim
        return RecurrentGroup(
            RecurrentStateSpec(
                num_layers=num_layers,
                conv_channels=channels,
                conv_width=self.conv_kernel - 1,
                num_heads=mine.num_value_heads,
                key_dim=self.key_head_dim,
                value_dim=self.value_head_dim,
                conv_dtype=dtype,
            )
        )
