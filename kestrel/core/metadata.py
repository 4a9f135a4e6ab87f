"""AttentionMetadata: typed per-batch facts an attention backend reads, one part per phase."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
