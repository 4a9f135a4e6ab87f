"""AttentionBackend: one attention implementation, with select / allocate / bind / execute apart.

- select: `registry.select_backend` checks each backend's declared `BackendCapabilities`;
- allocate: `allocate(workspace, max_rows, layer)` takes the persistent buffers the backend
  needs (split-K partials), once, from the `Workspace`; `kv_layout` says how the KV pool it
  reads is laid out, and the pool is built from it;
- bind: `bind(layout)` turns a step's plain-data layout into typed `AttentionMetadata`, and the
  graph hooks of `StepBinder` do the same through static buffers for captured graphs;
- execute: `forward(...)` stores the new keys and values and computes attention for one layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kestrel.core.batch import BatchLayout
from kestrel.core.binder import StepBinder
from kestrel.core.kernel_branches import kernel_devices
from kestrel.core.metadata import AttentionMetadata
from kestrel.core.state import FLOAT8_KV_DTYPES, KVLayerCache, KVLayout
from kestrel.core.workspace import Workspace


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What one attention layer asks of a backend."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    sinks: bool = False  # a learned logit per query head joins each softmax (GPT-OSS)
    # Chunked local attention (Llama 4): a token sees only the earlier tokens of its own chunk
    # of this many positions.
    chunk_size: int | None = None
    # Multi-head latent attention (DeepSeek): each key is a latent of this many dims followed
    # by its rotary part, shared by every head (one KV head), and the values are those latents:
    # the pool keeps keys only, and the output is `latent_dim` wide per head.
    latent_dim: int | None = None


# How a KV pool holds a layer's state: keys and values apart, or one latent per token whose
# leading dims are the values (multi-head latent attention).
SEPARATE_KV, LATENT_KV = "keys and values", "latent"


@dataclass(frozen=True)
class BackendCapabilities:
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | None  # None: any head size
    sliding_window: bool
    cuda_graphs: bool
    page_sizes: frozenset[int] | None  # None: any page size
    # KV pool dtypes it reads and writes besides the model's own (a quantized cache).
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()
    sinks: bool = False  # takes `forward(..., sinks=)`
    chunked_attention: bool = False  # masks by `AttentionLayerSpec.chunk_size`
    # The pools it reads: LATENT_KV reads values as the keys' leading `latent_dim` dims.
    kv_forms: frozenset[str] = frozenset({SEPARATE_KV})
    # Its kernels are Triton's: in tests they run on CPU tensors too (core/kernel_branches.py).
    triton: bool = False


@dataclass(frozen=True)
class BackendRequirements:
    """What a model on a runtime needs from its attention backend."""

    device: str
    dtype: torch.dtype
    head_dim: int
    sliding_window: bool
    page_size: int
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype
    sinks: bool = False
    chunked_attention: bool = False
    latent_kv: bool = False


class AttentionBackend(StepBinder, ABC):
    name: str
    capabilities: BackendCapabilities

    def __init__(self, device: torch.device, page_size: int) -> None:
        self.device = device
        self.page_size = page_size

    @classmethod
    def refusals(cls, needs: BackendRequirements) -> list[str]:
        """Why this backend cannot serve `needs`; empty when it can."""
        caps = cls.capabilities
        reasons = []
        devices = kernel_devices(caps.devices) if caps.triton else caps.devices
        if needs.device not in devices:
            reasons.append(f"device {needs.device} not in {sorted(devices)}")
        if needs.dtype not in caps.dtypes:
            reasons.append(f"dtype {needs.dtype} not supported")
        if caps.head_dims is not None and needs.head_dim not in caps.head_dims:
            reasons.append(f"head_dim {needs.head_dim} not in {sorted(caps.head_dims)}")
        if caps.page_sizes is not None and needs.page_size not in caps.page_sizes:
            reasons.append(f"page_size {needs.page_size} not in {sorted(caps.page_sizes)}")
        kv_dtype = needs.kv_cache_dtype or needs.dtype
        if kv_dtype != needs.dtype and kv_dtype not in caps.kv_cache_dtypes:
            reasons.append(f"kv cache dtype {kv_dtype} not supported")
        if needs.sliding_window and not caps.sliding_window:
            reasons.append("sliding-window attention not supported")
        if needs.sinks and not caps.sinks:
            reasons.append("attention sinks not supported")
        if needs.chunked_attention and not caps.chunked_attention:
            reasons.append("chunked local attention not supported")
        form = LATENT_KV if needs.latent_kv else SEPARATE_KV
        if form not in caps.kv_forms:
            reasons.append(f"{form} KV pools not supported (only {', '.join(sorted(caps.kv_forms))})")
        return reasons

    @classmethod
    def kv_layout(cls, dtype: torch.dtype) -> KVLayout:
        """How this backend wants the KV pool laid out: head-major pages; a float8 pool keeps
        each page's values slot-minor (see `KVLayerCache`)."""
        return KVLayout(values_by_slot=dtype in FLOAT8_KV_DTYPES)

    def allocate(self, workspace: Workspace, max_rows: int, layer: AttentionLayerSpec) -> None:
        """Reserve the persistent buffers a step of up to `max_rows` sequences of `layer`'s
        shape needs; the default backend needs none."""
        return None

    @abstractmethod
    def bind(self, layout: BatchLayout) -> AttentionMetadata:
        """Build the metadata for one step; called once per step, shared by every layer."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        metadata: AttentionMetadata,
        layer: AttentionLayerSpec,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store `key`/`value` [tokens, kv_heads, dim] in `cache`; return attention [tokens, heads,
        value dim]. A latent layer's `value` is a view of the key's leading dims (not stored again).
        `sinks` [heads] (layers with `layer.sinks`, backends with `capabilities.sinks`): one
        more logit per query head in each softmax's denominator, with no value of its own."""
