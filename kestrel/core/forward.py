"""ForwardContext: what a model's layers receive for one step, passed as an argument: each
state group's provider, binder and bound metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kestrel.core.attention.base import AttentionBackend, AttentionLayerSpec
from kestrel.core.batch import KV_GROUP
from kestrel.core.metadata import RecurrentMetadata
from kestrel.core.recurrent_state import RECURRENT_GROUP, RecurrentLayerState
from kestrel.core.state import StateGroup


@dataclass(frozen=True)
class BoundGroup:
    group: StateGroup
    metadata: Any  # what the group's binder made for this step


@dataclass(frozen=True)
class ForwardContext:
    groups: Mapping[str, BoundGroup]

    def bound(self, name: str) -> BoundGroup:
        bound = self.groups.get(name)
        if bound is None:
            raise RuntimeError(f"a layer asked for state group {name!r}, which this model's runner does not have")
        return bound

    def attend(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: AttentionLayerSpec,
        group: str = KV_GROUP,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bound = self.bound(group)
        backend: AttentionBackend = bound.group.binder
        cache = bound.group.provider.layer(layer_index)
        if sinks is None:
            return backend.forward(query, key, value, cache, bound.metadata, layer)
        return backend.forward(query, key, value, cache, bound.metadata, layer, sinks)

    def recurrent_state(
        self, layer_index: int, group: str = RECURRENT_GROUP
    ) -> tuple[RecurrentLayerState, RecurrentMetadata]:
        """The linear-attention layer's state slots and where this step's sequences keep theirs."""
        bound = self.bound(group)
        return bound.group.provider.layer(layer_index), bound.metadata


def bind_groups(groups: Mapping[str, StateGroup], bind: Any) -> ForwardContext:
    """A context whose metadata `bind(binder)` makes, group by group."""
    return ForwardContext({name: BoundGroup(group, bind(group.binder)) for name, group in groups.items()})
