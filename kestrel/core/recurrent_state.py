"""Recurrent state: a fixed-size slot per running request for linear-attention (gated DeltaNet)
layers, and the binder of where each step's sequences keep it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kestrel.core.batch import BatchLayout, to_device
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
    """One slot per running request, holding every linear-attention layer's state, and a pool
    of snapshots: copies of a state at a page boundary that the prefix cache keeps.

    A slot's size does not grow with the sequence, so `reserve` hands out one slot whatever
    the token count. Slots are not zeroed on reuse: a sequence that starts from its first
    token starts from zero state by itself (see `RecurrentMetadata.has_state`).

    A chunk's ids in this group are its slot, or (slot, read from, save to) where it starts
    from a snapshot or leaves its state in one too (`chunk_ids`): the kernels read and write
    snapshots as they read and write the slot, with no copies.

    A tentative chunk (speculative decoding's verify chunk, `mark_rollback_point`) reads the
    request's slot and writes a spare slot, so the state before it stays where it was: when
    every token of the chunk stands, the spare becomes the request's slot; otherwise the spare
    is dropped and the request steps back to the state before the chunk. No copies either way.
    """

    supports_graphs = True
    # Its layers' torch path traces whole for compiled CPU decode steps: decodes batched, ids
    # read on the device (`hybrid._save` writes the save slots without asking the host).
    compiles = True
    group = RECURRENT_GROUP

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, device: torch.device, num_snapshots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least one slot, got {num_slots}")
        self.spec = spec
        self.device = device
        self.num_slots = num_slots
        self.scratch_id = num_slots  # owned by no request: padded rows may write there
        self._free = list(range(num_slots - 1, -1, -1))
        self._owned: dict[str, int] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each request's state will reflect
        self._rollback_points: dict[str, int] = {}  # marked for the request's next chunk
        self._tentative: dict[str, tuple[int, int]] = {}  # request -> (spare slot, tokens its slot reflects)
        self.num_snapshots = num_snapshots
        first_snapshot = num_slots + 1
        self._free_snapshots = list(range(first_snapshot + num_snapshots - 1, first_snapshot - 1, -1))
        self._released_snapshots: list[int] = []  # free from the next step on
        units = num_slots + 1 + num_snapshots
        conv = torch.zeros(
            (spec.num_layers, units, spec.conv_channels, spec.conv_width), dtype=spec.conv_dtype, device=device
        )
        recurrent = torch.zeros(
            (spec.num_layers, units, spec.num_heads, spec.key_dim, spec.value_dim),
            dtype=spec.state_dtype,
            device=device,
        )
        self._layers = tuple(RecurrentLayerState(conv[i], recurrent[i]) for i in range(spec.num_layers))
        self._units = (conv, recurrent)  # every layer's units, for whole-unit copies

    def layer(self, index: int) -> RecurrentLayerState:
        return self._layers[index]

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        slot = self._owned.get(request_id)
        if slot is None:
            if not self._free:
                raise OutOfPagesError(f"request {request_id} needs a recurrent state slot but all are taken")
            slot = self._owned[request_id] = self._free.pop()
        self._num_tokens[request_id] = num_tokens
        point = self._rollback_points.pop(request_id, None)
        if point is None or not self._free:  # without a spare slot, a rollback starts over
            return [slot]
        spare = self._free.pop()
        self._tentative[request_id] = (spare, point)
        return list(chunk_ids(spare, read_from=slot))

    def mark_rollback_point(self, request_id: str, num_tokens: int) -> None:
        self._rollback_points[request_id] = num_tokens

    def release(self, request_id: str) -> None:
        self._num_tokens.pop(request_id, None)
        self._rollback_points.pop(request_id, None)
        tentative = self._tentative.pop(request_id, None)
        if tentative is not None:
            self._free.append(tentative[0])
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

    # ---- snapshots ----------------------------------------------------------------------

    def allocate_snapshot(self) -> int | None:
        return self._free_snapshots.pop() if self._free_snapshots else None

    def free_snapshot(self, snapshot: int) -> None:
        """Free from the next step on (`reclaim_snapshots`): a chunk of the step being planned
        may still save to it, and no other chunk of that step may."""
        self._released_snapshots.append(snapshot)

    def reclaim_snapshots(self) -> None:
        """A new step is planned: snapshots freed while planning the last one are free."""
        self._free_snapshots.extend(self._released_snapshots)
        self._released_snapshots.clear()

    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def unit_layout(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One unit (slot or snapshot) across every layer: convolution state, recurrent state."""
        return [((t.shape[0], *t.shape[2:]), t.dtype) for t in self._units]

    def unit_state(self, unit: int) -> list[torch.Tensor]:
        """Views of one unit's state, as `unit_layout` says (to copy out, or into)."""
        return [t[:, unit] for t in self._units]

    def rollback(self, request_id: str, num_tokens: int) -> int:
        """The state folds every token in: it cannot step back past a tentative chunk's start,
        so rolling back into one keeps the state before it, and any other rollback starts
        over (0 tokens kept; the sequence recomputes from its start)."""
        tentative = self._tentative.pop(request_id, None)
        if tentative is not None:
            spare, point = tentative
            if num_tokens >= self._num_tokens[request_id]:  # every token of the chunk stands
                self._free.append(self._owned[request_id])
                self._owned[request_id] = spare
                return num_tokens
            self._free.append(spare)
            self._num_tokens[request_id] = point
            return point
        if num_tokens >= self._num_tokens.get(request_id, 0):
            return num_tokens
        self._num_tokens[request_id] = 0
        return 0

    def export(self, request_id: str, place: torch.device) -> list[torch.Tensor]:
        slot = self._owned[request_id]
        return [
            torch.stack([layer.conv[slot] for layer in self._layers]).to(place),
            torch.stack([layer.recurrent[slot] for layer in self._layers]).to(place),
        ]

    def export_layout(self, num_tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        first = self._layers[0]
        layers = len(self._layers)
        return [
            ((layers, *first.conv.shape[1:]), first.conv.dtype),
            ((layers, *first.recurrent.shape[1:]), first.recurrent.dtype),
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
        sequences = self._sequences(layout)
        return self._metadata(
            sequences.num_decodes,
            tuple(sequences.query_start.tolist()),
            sequences.vectors,
            to_device(sequences.vectors, self.device),
            to_device(sequences.query_start.astype(np.int32), self.device),
        )

    def _sequences(self, layout: BatchLayout) -> StepSequences:
        """The step's sequences as the recurrence takes them. A chunk laid out as one-token
        rows of its sequence (the runner does so to replay a verify chunk in the decode
        graphs) is one sequence again: consecutive rows with the same ids, each starting
        where the one before ended. The kernels fold its rows in one after another from its
        read slot, exactly as they would the chunk."""
        chunks = layout.chunks
        if not chunks:
            return StepSequences(np.zeros((4, 0), dtype=np.int64), np.zeros(1, dtype=np.int64), 0)
        ids = np.array([_step_ids(chunk.ids_in(self.group)) for chunk in chunks]).T
        continues = (ids[:, 1:] == ids[:, :-1]).all(axis=0) & (layout.num_cached[1:] == layout.seq_lens[:-1])
        first = np.flatnonzero(np.concatenate(([True], ~continues)))
        vectors = np.empty((4, len(first)), dtype=np.int64)
        vectors[:3] = ids[:, first]
        vectors[3] = layout.num_cached[first] > 0
        query_start = layout.query_start_loc[np.append(first, len(chunks))]
        one_token = np.diff(query_start) == 1
        num_decodes = len(first) if one_token.all() else int(np.argmin(one_token))
        return StepSequences(vectors, query_start, num_decodes)

    @staticmethod
    def _metadata(num_decodes: int, query_start_loc, host, device, query_start) -> RecurrentMetadata:
        """host and device: [4, sequences] rows of slot, read slot, save slot, has state."""
        slots, reads, saves, has_state = (tuple(int(v) for v in row) for row in host)
        return RecurrentMetadata(
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            slot_ids=slots,
            read_ids=reads,
            save_ids=saves,
            has_state=tuple(bool(v) for v in has_state),
            slots=device[0],
            read_slots=device[1],
            save_slots=device[2],
            has_state_tensor=device[3] != 0,  # inside a capture, recomputed at each replay
            query_start=query_start,
        )

    def prepare_capture(self, workspace: Workspace, provider: StateProvider, max_rows: int, max_pages: int) -> None:
        scratch = provider.scratch_id
        workspace.reserve(_GRAPH_VECTORS, 4 * max_rows, torch.long)
        self._graph_vectors = workspace.get(_GRAPH_VECTORS, (4, max_rows), torch.long)
        self._graph_vectors[:3].fill_(scratch)
        self._graph_vectors[3].fill_(0)
        # A decode graph's rows are one token each, whichever sequences fill them.
        workspace.reserve(_GRAPH_QUERY_START, max_rows + 1, torch.int32)
        self._graph_query_start = workspace.get(_GRAPH_QUERY_START, (max_rows + 1,), torch.int32)
        self._graph_query_start.copy_(torch.arange(max_rows + 1, dtype=torch.int32))
        self._graph_rows_chained = False  # whether the query starts hold a chained layout

    def capture_metadata(self, num_rows: int) -> RecurrentMetadata:
        host = np.zeros((4, num_rows), dtype=np.int64)
        host[:3] = self.scratch_id
        return self._metadata(
            num_rows,
            tuple(range(num_rows + 1)),
            host,
            self._graph_vectors[:, :num_rows],
            self._graph_query_start[: num_rows + 1],
        )

    def prepare_replay(self, layout: BatchLayout, num_rows: int) -> None:
        """The graph's `num_rows` entries: the step's sequences (`_sequences`), then each
        padded row as a sequence of its own on the scratch slot, then, where a chunk's rows
        were chained, entries of no rows (their programs fold nothing in and write the scratch)."""
        sequences = self._sequences(layout)
        count, real_rows = sequences.vectors.shape[1], layout.num_tokens
        padded = num_rows - real_rows
        vectors = np.zeros((4, num_rows), dtype=np.int64)
        vectors[:3] = self.scratch_id
        vectors[:, :count] = sequences.vectors
        self._graph_vectors[:, :num_rows].copy_(to_device(vectors, self.device))
        chained = count < real_rows
        if chained or self._graph_rows_chained:
            query_start = np.full(num_rows + 1, num_rows, dtype=np.int32)
            query_start[:count] = sequences.query_start[:-1]
            query_start[count : count + padded] = np.arange(real_rows, num_rows)
            self._graph_query_start[: num_rows + 1].copy_(to_device(query_start, self.device))
            # Restored to one row per entry at the next replay without chains.
            self._graph_rows_chained = chained


@dataclass(frozen=True)
class StepSequences:
    """The sequences one step's recurrent layers fold in, in layout order."""

    vectors: np.ndarray  # [4, sequences]: slot, read slot, save slot, has state
    query_start: np.ndarray  # [sequences + 1]: the token row where each starts, and the end
    num_decodes: int  # the leading sequences of one token


def chunk_ids(slot: int, read_from: int | None = None, save_to: int | None = None) -> tuple[int, ...]:
    """A chunk's ids in the recurrent group: its slot, and where it starts from and leaves
    its state besides (a snapshot), where not the slot itself."""
    if read_from is None and save_to is None:
        return (slot,)
    return (slot, slot if read_from is None else read_from, slot if save_to is None else save_to)


def _step_ids(ids: tuple[int, ...]) -> tuple[int, int, int]:
    """(slot, read from, save to) of a chunk's ids (`chunk_ids`)."""
    return (ids[0], ids[0], ids[0]) if len(ids) == 1 else (ids[0], ids[1], ids[2])


_GRAPH_VECTORS = "recurrent.graph.slots_reads_saves_has_state"
_GRAPH_QUERY_START = "recurrent.graph.query_start"
