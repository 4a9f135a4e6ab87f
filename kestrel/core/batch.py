"""What one step computes, as plain data (`BatchLayout`) and as tensors (`BatchInputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: which new tokens it brings and where its KV lives."""

    query_len: int
    num_cached_tokens: int  # tokens already in the KV cache before this step
    page_ids: tuple[int, ...]

    @property
    def seq_len(self) -> int:
        return self.num_cached_tokens + self.query_len


@dataclass(frozen=True)
class BatchLayout:
    """The sequences of one step in execution order: all decodes (one new token) first."""

    chunks: tuple[SequenceChunk, ...]
    num_decodes: int
    page_size: int

    @property
    def num_prefills(self) -> int:
        return len(self.chunks) - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(chunk.query_len for chunk in self.chunks)

    def slot_mapping(self) -> np.ndarray:
        """The flat KV slot (page * page_size + offset) of every new token, in row order."""
        query_lens = np.array([chunk.query_len for chunk in self.chunks], dtype=np.int64)
        cached = np.array([chunk.num_cached_tokens for chunk in self.chunks], dtype=np.int64)
        rows = np.repeat(np.arange(len(self.chunks)), query_lens)
        first_token_row = np.cumsum(query_lens) - query_lens
        positions = cached[rows] + np.arange(len(rows)) - first_token_row[rows]
        pages = page_table(self.chunks)[rows, positions // self.page_size]
        return pages * self.page_size + positions % self.page_size


def query_start_loc(chunks: Sequence[SequenceChunk], first_row: int = 0) -> list[int]:
    """The token row where each chunk's new tokens start, plus the row after the last."""
    starts = [first_row]
    for chunk in chunks:
        starts.append(starts[-1] + chunk.query_len)
    return starts


def page_table(chunks: Sequence[SequenceChunk], fill: int = 0, num_rows: int | None = None) -> np.ndarray:
    """[num_rows, widest chunk's pages] page ids, padded with `fill`; rows past the chunks
    hold `fill` alone. Built by row slices: a nested list through `torch.tensor` costs
    milliseconds at a few hundred long sequences."""
    width = max(len(chunk.page_ids) for chunk in chunks)
    table = np.full((num_rows or len(chunks), width), fill, dtype=np.int64)
    for row, chunk in zip(table, chunks):
        row[: len(chunk.page_ids)] = chunk.page_ids
    return table


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host integers onto `device`; through pinned memory on CUDA, so the copy does not
    wait for the host."""
    return _onto(torch.from_numpy(values), device)


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
    return _onto(torch.tensor(values, dtype=dtype), device)


def _onto(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
