"""What the paged backends share: binding a step's plain-data layout into typed
AttentionMetadata, and the shape of a forward (store the new KV, then the decode part, then
the prefill part). A backend supplies only `store`, `decode` and `prefill`."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from kestrel.core.attention.base import AttentionBackend, AttentionLayerSpec
from kestrel.core.batch import KV_GROUP, BatchLayout, page_table, to_device
from kestrel.core.graph import GraphPhase
from kestrel.core.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from kestrel.core.state import KVLayerCache, StateProvider
from kestrel.core.workspace import Workspace


class PagedAttentionBackend(AttentionBackend):
    """A backend that reads the paged pool of one state group through page tables."""

    group = KV_GROUP  # the state group whose pages this backend reads

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.store(cache, key, value, metadata.slot_mapping)
        output = query.new_empty((*query.shape[:-1], value.shape[-1]))
        # Only backends that declare sinks are selected for layers that have them.
        extra = {"sinks": sinks} if sinks is not None else {}
        if metadata.decode is not None:
            self.decode(query, key, value, cache, metadata.decode, layer, output, **extra)
        if metadata.prefill is not None:
            self.prefill(query, key, value, cache, metadata.prefill, layer, output, **extra)
        return output

    def bind(self, layout: BatchLayout) -> AttentionMetadata:
        decodes = layout.num_decodes
        return AttentionMetadata(
            phase=GraphPhase.of(decodes, layout.num_prefills),
            slot_mapping=to_device(layout.slot_mapping(self.group), self.device),
            decode=self._decode_metadata(layout) if decodes else None,
            prefill=self._prefill_metadata(layout) if layout.num_prefills else None,
        )

    def _decode_metadata(self, layout: BatchLayout) -> DecodeMetadata:
        count = layout.num_decodes
        seq_lens = layout.seq_lens[:count]
        return DecodeMetadata(
            num_seqs=count,
            seq_lens=to_device(seq_lens, self.device),
            page_table=to_device(page_table(layout.chunks[:count], group=self.group), self.device),
            max_seq_len=int(seq_lens.max()),
        )

    def _prefill_metadata(self, layout: BatchLayout) -> PrefillMetadata:
        first = layout.num_decodes
        starts = layout.query_start_loc[first:]
        cached = layout.num_cached[first:]
        return PrefillMetadata(
            query_start_loc=tuple(starts.tolist()),
            num_cached_tokens=tuple(cached.tolist()),
            seq_lens=tuple(layout.seq_lens[first:].tolist()),
            page_table=to_device(page_table(layout.chunks[first:], group=self.group), self.device),
            query_start_loc_tensor=to_device(starts, self.device),
            num_cached_tokens_tensor=to_device(cached, self.device),
            max_query_len=int(layout.query_lens[first:].max()),
        )

    # ---- graph hooks: decode steps, each row one new token ---------------------------------

    supports_graphs = True

    def prepare_capture(self, workspace: Workspace, provider: StateProvider, max_rows: int, max_pages: int) -> None:
        scratch = provider.scratch_id
        workspace.reserve(_GRAPH_VECTORS, 2 * max_rows, torch.long)
        workspace.reserve(_GRAPH_PAGE_TABLE, max_rows * max_pages, torch.long)
        self._graph_vectors = workspace.get(_GRAPH_VECTORS, (2, max_rows), torch.long)
        self._graph_page_table = workspace.get(_GRAPH_PAGE_TABLE, (max_rows, max_pages), torch.long)
        self._scratch = scratch
        # Every row a padded one until the first replay fills them.
        self._graph_vectors[0].fill_(scratch * self.page_size)
        self._graph_vectors[1].fill_(1)
        self._graph_page_table.fill_(scratch)

    def capture_metadata(self, num_rows: int) -> AttentionMetadata:
        slots, seq_lens = self._graph_vectors[:, :num_rows]
        # max_seq_len 0: graph-safe backends size their launches without it.
        decode = DecodeMetadata(num_rows, seq_lens, self._graph_page_table[:num_rows], max_seq_len=0)
        return AttentionMetadata(phase=GraphPhase.DECODE, slot_mapping=slots, decode=decode, prefill=None)

    def prepare_replay(self, layout: BatchLayout, num_rows: int) -> None:
        self._fill_graph_buffers(layout, num_rows)

    def _fill_graph_buffers(self, layout: BatchLayout, num_rows: int) -> np.ndarray:
        """Padded rows decode into the scratch page and attend to it alone: one host array and
        one copy for both vectors, one for the page table, which is returned."""
        count = len(layout.chunks)
        vectors = np.empty((2, num_rows), dtype=np.int64)
        vectors[0] = self._scratch * self.page_size
        vectors[0, :count] = layout.slot_mapping(self.group)
        vectors[1] = 1
        vectors[1, :count] = layout.seq_lens
        table = layout.page_table(self.group, fill=self._scratch, num_rows=num_rows)
        self._graph_vectors[:, :num_rows].copy_(to_device(vectors, self.device))
        self._graph_page_table[:num_rows, : table.shape[1]].copy_(to_device(table, self.device))
        return table


_GRAPH_VECTORS = "attention.graph.slots_and_seq_lens"
_GRAPH_PAGE_TABLE = "attention.graph.page_table"
