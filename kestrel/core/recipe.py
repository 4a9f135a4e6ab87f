"""ModelRecipe: how one Hugging Face architecture maps onto Kestrel, and the `ModelSpec` it
resolves a config into: the few facts every model has, and one `LayerSpec` per layer. A
family's own fields (heads, experts, norms) live in its recipe's subclass, in `models/`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from kestrel.core.layer_spec import AttentionLayer, LayerSpec, StateGroupSpec
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import WeightBindings


@dataclass(frozen=True)
class ModelSpec:
    """An architecture's shape, resolved once from `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    layers: tuple[LayerSpec, ...] = ()  # one per layer, in order

    def group_index(self, index: int) -> int:
        """The layer's position among the layers of its state group: its index in that pool."""
        group = self.layers[index].state_group
        return sum(1 for layer in self.layers[:index] if layer.state_group == group)

    def state_groups(
        self, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, parallel: TensorParallel = SINGLE
    ) -> dict[str, StateGroupSpec]:
        """One spec per state group the layers name, for one rank, in first-use order."""
        members: dict[str, list[LayerSpec]] = {}
        for layer in self.layers:
            members.setdefault(layer.state_group, []).append(layer)
        return {
            name: layers[0].group_spec(len(layers), dtype, kv_dtype, page_size, parallel)
            for name, layers in members.items()
        }

    def attention_layers(self) -> list[AttentionLayer]:
        return [layer for layer in self.layers if isinstance(layer, AttentionLayer)]


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
