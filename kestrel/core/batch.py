"""What one step computes, as plain data (`BatchLayout`) and as tensors (`BatchInputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

KV_GROUP = "kv"  # the state group of the full-attention layers, whose pages `page_ids` names


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: which new tokens it brings and where its state lives."""

    query_len: int
    num_cached_tokens: int  # tokens already in the KV cache before this step
    page_ids: tuple[int, ...]  # its pages in the KV group
    # What it holds in every other state group (more pages, or a recurrent state slot).
    state_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.num_cached_tokens + self.query_len

    def ids_in(self, group: str) -> tuple[int, ...]:
        return self.page_ids if group == KV_GROUP else self.state_ids[group]


@dataclass(frozen=True)
class BatchLayout:
    """The sequences of one step in execution order, one-token rows (decodes) first, and the
    step's geometry, computed once here and read by every binder and by captured graphs:
    positions, query start offsets, sequence lengths, page tables and slot mappings."""

    chunks: tuple[SequenceChunk, ...]
    num_decodes: int
    page_size: int

    @property
    def num_prefills(self) -> int:
        return len(self.chunks) - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @cached_property
    def query_lens(self) -> np.ndarray:
        return np.array([chunk.query_len for chunk in self.chunks], dtype=np.int64)

    @cached_property
    def num_cached(self) -> np.ndarray:
        return np.array([chunk.num_cached_tokens for chunk in self.chunks], dtype=np.int64)

    @cached_property
    def seq_lens(self) -> np.ndarray:
        return self.num_cached + self.query_lens

    @cached_property
    def query_start_loc(self) -> np.ndarray:
        """The token row where each chunk's new tokens start, plus the row after the last."""
        return np.concatenate(([0], np.cumsum(self.query_lens)))

    @cached_property
    def token_rows(self) -> np.ndarray:
        """Which chunk each token row belongs to."""
        return np.repeat(np.arange(len(self.chunks)), self.query_lens)

    @cached_property
    def positions(self) -> np.ndarray:
        """Every new token's position in its sequence, in row order."""
        rows = self.token_rows
        return self.num_cached[rows] + np.arange(len(rows)) - self.query_start_loc[rows]

    def page_table(self, group: str = KV_GROUP, fill: int = 0, num_rows: int | None = None) -> np.ndarray:
        """[num_rows, widest chunk's pages] of the group's page ids, padded with `fill`."""
        return page_table(self.chunks, fill, num_rows, group)

    def slot_mapping(self, group: str = KV_GROUP) -> np.ndarray:
        """The flat KV slot (page * page_size + offset) of every new token, in row order."""
        positions = self.positions
        pages = self.page_table(group)[self.token_rows, positions // self.page_size]
        return pages * self.page_size + positions % self.page_size


def page_table(
    chunks: Sequence[SequenceChunk], fill: int = 0, num_rows: int | None = None, group: str = KV_GROUP
) -> np.ndarray:
    """[num_rows, widest chunk's pages] page ids, padded with `fill`; rows past the chunks
    hold `fill` alone. Built by row slices: a nested list through `torch.tensor` costs
    milliseconds at a few hundred long sequences."""
    ids = [chunk.ids_in(group) for chunk in chunks]
    width = max(len(row_ids) for row_ids in ids)
    table = np.full((num_rows or len(chunks), width), fill, dtype=np.int64)
    for row, row_ids in zip(table, ids):
        row[: len(row_ids)] = row_ids
    return table


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host integers onto `device`; through pinned memory on CUDA, so the copy does not
    wait for the host."""
    return host_to_device(torch.from_numpy(values), device)


@dataclass(frozen=True)
class BatchInputs:
    """The model's tensor inputs for one step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed


def values_to_device(values: Sequence[int | float | bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list onto `device` without waiting for the device: `torch.tensor(...,
    device=cuda)` copies from pageable memory, which waits for all queued GPU work and would
    stall a step launched while the previous one still runs."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` by a pinned, non-blocking copy (see `values_to_device`)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
