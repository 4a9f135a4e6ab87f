"""ForwardContext: what a model's attention layers receive for one step, passed as an argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.core.attention.base import AttentionBackend, AttentionLayerSpec
from kestrel.core.metadata import AttentionMetadata
from kestrel.core.state import PagedKVProvider


@dataclass(frozen=True)
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv: PagedKVProvider

    def attend(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:
        cache = self.kv.layer(layer_index)
        return self.backend.forward(query, key, value, cache, self.metadata, layer)
