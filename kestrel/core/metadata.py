"""AttentionMetadata: typed per-batch facts an attention backend reads, one part per phase."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kestrel.core.batch import host_to_device
from kestrel.core.graph import GraphPhase


@dataclass(frozen=True)
class DecodeMetadata:
    """Sequences with one new token each; they occupy the first `num_seqs` token rows."""

    num_seqs: int
    seq_lens: torch.Tensor  # [num_seqs], context length including the new token
    page_table: torch.Tensor  # [num_seqs, max_pages], padded with page 0
    max_seq_len: int


@dataclass(frozen=True)
class PrefillMetadata:
    """Sequences with several new tokens, possibly after an already cached prefix.

    The same facts as host tuples (for loops on the host) and device tensors (for kernels).
    """

    query_start_loc: tuple[int, ...]  # token row where each sequence starts, plus the end
    num_cached_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    page_table: torch.Tensor  # [num_seqs, max_pages], padded with page 0
    query_start_loc_tensor: torch.Tensor  # [num_seqs + 1]
    num_cached_tokens_tensor: torch.Tensor  # [num_seqs]
    max_query_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    phase: GraphPhase
    slot_mapping: torch.Tensor  # [num_tokens], flat KV slot (page * page_size + offset) per token
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


@dataclass(frozen=True)
class RecurrentMetadata:
    """Where each sequence of a step keeps its linear-attention state, in layout order
    (decodes first).

    A sequence reads its starting state from its read slot (its own slot, or a prefix-cache
    snapshot it starts from) and leaves its final state in its slot and in its save slot (its
    own slot again, or a snapshot the prefix cache keeps). A sequence with no cached tokens
    starts from zero state, whatever its slot held before."""

    num_decodes: int
    query_start_loc: tuple[int, ...]  # token row where each sequence starts, plus the end
    slot_ids: tuple[int, ...]
    read_ids: tuple[int, ...]
    save_ids: tuple[int, ...]
    has_state: tuple[bool, ...]
    slots: torch.Tensor  # [num_seqs] on the device, as the three rows below
    read_slots: torch.Tensor
    save_slots: torch.Tensor
    has_state_tensor: torch.Tensor  # [num_seqs] bool
    query_start: torch.Tensor  # [num_seqs + 1] int32 on the device: query_start_loc, for kernels
    # What `prefill_chunks` made this step, by chunk size: every layer of the step reads it.
    _prefill_chunks: dict[int, PrefillChunks] = field(default_factory=dict, compare=False, repr=False)

    def prefill_chunks(self, chunk: int) -> PrefillChunks:
        """The step's prefill sequences (those after the decodes) in chunks of `chunk` tokens,
        made on the first call of a step and shared by all its layers."""
        if chunk not in self._prefill_chunks:
            self._prefill_chunks[chunk] = PrefillChunks.of(self, chunk)
        return self._prefill_chunks[chunk]


@dataclass(frozen=True)
class PrefillChunks:
    """A step's prefill sequences cut into chunks, for kernels that take a prefill a chunk at a
    time (the chunked gated delta rule): the sequences' row bounds counted from the first
    prefill row, and each chunk's (sequence, chunk within it)."""

    bounds: torch.Tensor  # [prefills + 1] int64 on the host
    bounds_on_device: torch.Tensor
    chunks_on_device: torch.Tensor  # [chunks, 2] int64

    @classmethod
    def of(cls, meta: RecurrentMetadata, chunk: int) -> PrefillChunks:
        starts = meta.query_start_loc[meta.num_decodes :]
        bounds = torch.tensor(starts, dtype=torch.long) - starts[0]
        chunks = chunk_indices(bounds, chunk)
        # Both in one pinned buffer and one copy that does not wait for the device.
        on_device = host_to_device(torch.cat((bounds, chunks.flatten())), meta.query_start.device)
        return cls(bounds, on_device[: len(bounds)], on_device[len(bounds) :].view(-1, 2))


def chunk_indices(bounds: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each chunk's (sequence, chunk within it) for the sequences `bounds` (int64) delimit:
    [chunks, 2] int64. An empty sequence has none."""
    counts = (bounds.diff() + chunk - 1) // chunk
    sequences = torch.repeat_interleave(torch.arange(len(counts)), counts)
    firsts = torch.cumsum(counts, 0) - counts
    return torch.stack((sequences, torch.arange(len(sequences)) - firsts[sequences]), dim=1)
