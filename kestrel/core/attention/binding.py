"""What the paged backends share: binding a step's plain-data layout into typed
AttentionMetadata, and the shape of a forward (store the new KV, then the decode part, then
the prefill part). A backend supplies only `store`, `decode` and `prefill`."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from kestrel.core.attention.base import AttentionBackend, AttentionLayerSpec
from kestrel.core.batch import BatchLayout, SequenceChunk, page_table, query_start_loc, to_device
from kestrel.core.graph import GraphPhase
from kestrel.core.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from kestrel.core.state import KVLayerCache


class PagedAttentionBackend(AttentionBackend):
    """A backend that reads the paged pool through page tables."""

    @abstractmethod
    def store(self, cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Write key, value [tokens, kv_heads, dim] into their slots."""

    @abstractmethod
    def decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        meta: DecodeMetadata,
        layer: AttentionLayerSpec,
        output: torch.Tensor,
    ) -> None:
        """Attention for the decode rows (the first `meta.num_seqs`), written into `output`.

        `key` and `value` are the step's new rows, already stored in `cache`: a backend may
        read them from either place.
        """

    @abstractmethod
    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        meta: PrefillMetadata,
        layer: AttentionLayerSpec,
        output: torch.Tensor,
    ) -> None:
        """Attention for the prefill rows, written into `output`."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        metadata: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:
        self.store(cache, key, value, metadata.slot_mapping)
        output = torch.empty_like(query)
        if metadata.decode is not None:
            self.decode(query, key, value, cache, metadata.decode, layer, output)
        if metadata.prefill is not None:
            self.prefill(query, key, value, cache, metadata.prefill, layer, output)
        return output

    def bind(self, layout: BatchLayout) -> AttentionMetadata:
        decodes = layout.chunks[: layout.num_decodes]
        prefills = layout.chunks[layout.num_decodes :]
        return AttentionMetadata(
            phase=GraphPhase.of(len(decodes), len(prefills)),
            slot_mapping=to_device(layout.slot_mapping(), self.device),
            decode=self._decode_metadata(decodes) if decodes else None,
            prefill=self._prefill_metadata(prefills, layout.num_decodes) if prefills else None,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(np.array(values, dtype=np.int64), self.device)

    def _page_table(self, chunks: tuple[SequenceChunk, ...]) -> torch.Tensor:
        return to_device(page_table(chunks), self.device)

    def _decode_metadata(self, chunks: tuple[SequenceChunk, ...]) -> DecodeMetadata:
        seq_lens = [chunk.seq_len for chunk in chunks]
        return DecodeMetadata(
            num_seqs=len(chunks),
            seq_lens=self._tensor(seq_lens),
            page_table=self._page_table(chunks),
            max_seq_len=max(seq_lens),
        )

    def _prefill_metadata(self, chunks: tuple[SequenceChunk, ...], first_row: int) -> PrefillMetadata:
        starts = query_start_loc(chunks, first_row)
        cached = [chunk.num_cached_tokens for chunk in chunks]
        return PrefillMetadata(
            query_start_loc=tuple(starts),
            num_cached_tokens=tuple(cached),
            seq_lens=tuple(chunk.seq_len for chunk in chunks),
            page_table=self._page_table(chunks),
            query_start_loc_tensor=self._tensor(starts),
            num_cached_tokens_tensor=self._tensor(cached),
            max_query_len=max(chunk.query_len for chunk in chunks),
        )
