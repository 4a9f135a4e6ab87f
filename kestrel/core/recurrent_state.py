"""Recurrent state: a fixed-size slot per running request for linear-attention (gated DeltaNet)
layers, and the binder of where each step's sequences keep it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kestrel.core.batch import BatchLayout, to_device, values_to_device
from kestrel.core.binder import StepBinder
from kestrel.core.metadata import RecurrentMetadata
from kestrel.core.state import OutOfPagesError, StateProvider
from kestrel.core.workspace import Workspace

RECURRENT_GROUP = "recurrent"


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The fixed-size state one stack of linear-attention (gated DeltaNet) layers keeps per
    request: the last inputs of the causal convolution and the recurrent matrix per head."""

    num_layers: int
    conv_channels: int
    conv_width: int  # inputs kept: the kernel size minus one
    num_heads: int
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    state_dtype: torch.dtype = torch.float32  # the recurrence accumulates: kept in float32

    def bytes_per_slot(self) -> int:
        conv = self.conv_channels * self.conv_width * torch.empty((), dtype=self.conv_dtype).element_size()
        state = self.num_heads * self.key_dim * self.value_dim * torch.empty((), dtype=self.state_dtype).element_size()
        return self.num_layers * (conv + state)


@dataclass(frozen=True)
class RecurrentLayerState:
    """One linear-attention layer's slots: conv [slots, channels, width] and
    recurrent [slots, heads, key_dim, value_dim]."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class RecurrentStateProvider(StateProvider, StepBinder):
    """One slot per running request, holding every linear-attention layer's state.

    A slot's size does not grow with the sequence, so `reserve` hands out one slot whatever
    the token count. Slots are not zeroed on reuse: a sequence that starts from its first
    token starts from zero state by itself (see `RecurrentMetadata.has_state`).
    """

    supports_graphs = True
    group = RECURRENT_GROUP

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least one slot, got {num_slots}")
        self.spec = spec
        self.device = device
        self.num_slots = num_slots
        self.scratch_id = num_slots  # owned by no request: padded rows may write there
        self._free = list(range(num_slots - 1, -1, -1))
        self._owned: dict[str, int] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each request's state will reflect
        slots = num_slots + 1
        conv = torch.zeros(
            (spec.num_layers, slots, spec.conv_channels, spec.conv_width), dtype=spec.conv_dtype, device=device
        )
        recurrent = torch.zeros(
            (spec.num_layers, slots, spec.num_heads, spec.key_dim, spec.value_dim),
            dtype=spec.state_dtype,
            device=device,
        )
        self._layers = tuple(RecurrentLayerState(conv[i], recurrent[i]) for i in range(spec.num_layers))

    def layer(self, index: int) -> RecurrentLayerState:
        return self._layers[index]

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        slot = self._owned.get(request_id)
        if slot is None:
            if not self._free:
                raise OutOfPagesError(f"request {request_id} needs a recurrent state slot but all are taken")
            slot = self._owned[request_id] = self._free.pop()
        self._num_tokens[request_id] = num_tokens
        return [slot]

    def release(self, request_id: str) -> None:
        self._num_tokens.pop(request_id, None)
        slot = self._owned.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def free_capacity(self) -> int:
        return len(self._free)

    def total_capacity(self) -> int:
        return self.num_slots

    def held_by(self, request_id: str) -> list[int]:
        slot = self._owned.get(request_id)
        return [] if slot is None else [slot]

    @property
    def num_used_slots(self) -> int:
        return len(self._owned)

    def rollback(self, request_id: str, num_tokens: int) -> int:
        """The state folds every token in: it cannot step back, so rolling back at all means
        starting over (0 tokens kept; the sequence recomputes from its start)."""
        if num_tokens >= self._num_tokens.get(request_id, 0):
            return num_tokens
        self._num_tokens[request_id] = 0
        return 0

    def export(self, request_id: str) -> list[torch.Tensor]:
        slot = self._owned[request_id]
        return [torch.stack([layer.conv[slot] for layer in self._layers]).cpu()] + [
            torch.stack([layer.recurrent[slot] for layer in self._layers]).cpu()
        ]

    def import_state(self, request_id: str, num_tokens: int, state: list[torch.Tensor]) -> list[int]:
        (slot,) = self.reserve(request_id, num_tokens)
        conv, recurrent = state
        for index, layer in enumerate(self._layers):
            layer.conv[slot].copy_(conv[index])
            layer.recurrent[slot].copy_(recurrent[index])
        return [slot]

    # ---- the binder of its own per-step metadata -------------------------------------------

    def bind(self, layout: BatchLayout) -> RecurrentMetadata:
        slot_ids = tuple(chunk.ids_in(self.group)[0] for chunk in layout.chunks)
        has_state = tuple(chunk.num_cached_tokens > 0 for chunk in layout.chunks)
        return RecurrentMetadata(
            num_decodes=layout.num_decodes,
            query_start_loc=tuple(layout.query_start_loc.tolist()),
            slot_ids=slot_ids,
            has_state=has_state,
            slots=values_to_device(slot_ids, torch.long, self.device),
            has_state_tensor=values_to_device(has_state, torch.bool, self.device),
            query_start=to_device(layout.query_start_loc.astype(np.int32), self.device),
        )

    def prepare_capture(self, workspace: Workspace, scratch: int, max_rows: int, max_pages: int) -> None:
        workspace.reserve(_GRAPH_SLOTS, 2 * max_rows, torch.long)
        self._graph_vectors = workspace.get(_GRAPH_SLOTS, (2, max_rows), torch.long)
        self._graph_vectors[0].fill_(scratch)
        self._graph_vectors[1].fill_(0)
        # A decode graph's rows are one token each, whichever sequences fill them.
        workspace.reserve(_GRAPH_QUERY_START, max_rows + 1, torch.int32)
        self._graph_query_start = workspace.get(_GRAPH_QUERY_START, (max_rows + 1,), torch.int32)
        self._graph_query_start.copy_(torch.arange(max_rows + 1, dtype=torch.int32))

    def capture_metadata(self, num_rows: int) -> RecurrentMetadata:
        slots, has_state = self._graph_vectors[:, :num_rows]
        return RecurrentMetadata(
            num_decodes=num_rows,
            query_start_loc=tuple(range(num_rows + 1)),
            slot_ids=(self.scratch_id,) * num_rows,
            has_state=(False,) * num_rows,
            slots=slots,
            has_state_tensor=has_state != 0,  # computed inside the capture: replayed each step
            query_start=self._graph_query_start[: num_rows + 1],
        )

    def prepare_replay(self, layout: BatchLayout, num_rows: int) -> None:
        """Padded rows step the scratch slot from zero state."""
        count = len(layout.chunks)
        vectors = np.zeros((2, num_rows), dtype=np.int64)
        vectors[0] = self.scratch_id
        vectors[0, :count] = [chunk.ids_in(self.group)[0] for chunk in layout.chunks]
        vectors[1, :count] = layout.num_cached > 0
        self._graph_vectors[:, :num_rows].copy_(to_device(vectors, self.device))


_GRAPH_SLOTS = "recurrent.graph.slots_and_has_state"
_GRAPH_QUERY_START = "recurrent.graph.query_start"
