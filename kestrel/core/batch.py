"""What one step computes, as plain data (`BatchLayout`) and as tensors (`BatchInputs`)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class BatchInputs:
    """The model's tensor inputs for one step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed
