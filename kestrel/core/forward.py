"""ForwardContext: what a model's attention layers receive for one step, passed as an argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.core.attention.base import AttentionBackend, AttentionLayerSpec
from kestrel.core.metadata import AttentionMetadata, RecurrentMetadata
from kestrel.core.state import PagedKVProvider, RecurrentLayerState, RecurrentStateProvider


@dataclass(frozen=True)
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv: PagedKVProvider
    recurrent: RecurrentStateProvider | None = None  # hybrid models: linear-attention state
    recurrent_metadata: RecurrentMetadata | None = None

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

    def recurrent_state(self, layer_index: int) -> tuple[RecurrentLayerState, RecurrentMetadata]:
        """The linear-attention layer's state slots and where this step's sequences keep theirs."""
        if self.recurrent is None or self.recurrent_metadata is None:
            raise RuntimeError("a linear-attention layer ran without a recurrent state provider")
        return self.recurrent.layer(layer_index), self.recurrent_metadata
