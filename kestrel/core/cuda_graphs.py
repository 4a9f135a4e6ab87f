"""CUDA graphs for decode steps: static buffers, buckets captured largest first into one
memory pool, padding to the bucket, and replay keyed by `GraphKey`.

Padded rows decode one throwaway token: they write to the pool's scratch page and attend
to it alone, so they touch no request's state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from kestrel.core.attention.base import AttentionBackend
from kestrel.core.batch import BatchLayout, page_table, to_device
from kestrel.core.forward import ForwardContext
from kestrel.core.graph import GraphKey, GraphPhase
from kestrel.core.metadata import AttentionMetadata, DecodeMetadata
from kestrel.core.state import PagedKVProvider


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, up to `max_num_seqs`."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        buckets.append(size)
        size += 8 if size < 64 else 16
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv: PagedKVProvider,
        max_num_seqs: int,
        max_pages_per_seq: int,
    ) -> None:
        self.model, self.backend, self.kv = model, backend, kv
        self.buckets = decode_buckets(max_num_seqs)
        device = kv.layer(0).key.device
        largest = self.buckets[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        # One buffer for the per-row vectors, so a step fills them with one copy.
        self.vectors = buffer(4, largest)
        self.input_ids, self.positions, self.slots, self.seq_lens = self.vectors
        self.page_table = buffer(largest, max_pages_per_seq)
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: dict[GraphKey, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            phase=GraphPhase.DECODE,
            slot_mapping=self.slots[:size],
            decode=DecodeMetadata(size, self.seq_lens[:size], self.page_table[:size], max_seq_len=0),
            prefill=None,
        )
        hidden = self.model(
            self.input_ids[:size], self.positions[:size], ForwardContext(self.backend, metadata, self.kv)
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        scratch = self.kv.scratch_page  # every row a padded one until the first step fills them
        self.slots.fill_(scratch * self.kv.spec.page_size)
        self.seq_lens.fill_(1)
        self.page_table[:, 0] = scratch
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.buckets):  # largest first, so smaller ones fit in its pool
            key = GraphKey(GraphPhase.DECODE, size)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[key] = self._forward(size)
            self._graphs[key] = graph
        torch.cuda.synchronize()

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(
        self,
        layout: BatchLayout,
        token_ids: Sequence[int],
        positions: Sequence[int],
        fill_input_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only step, by replaying the bucket's graph.

        `fill_input_ids`, if given, amends the static input ids on the device before the
        replay (the runner writes tokens sampled by the previous step, not yet on the host).
        """
        count = len(layout.chunks)
        size = self.bucket_for(count)
        scratch = self.kv.scratch_page
        # Padded rows decode token 0 at position 0 into the scratch page: one host array and
        # one copy for the four vectors, padding included, instead of a launch per vector.
        vectors = np.zeros((4, size), dtype=np.int64)
        vectors[0, :count] = token_ids
        vectors[1, :count] = positions
        table = page_table(layout.chunks, fill=scratch, num_rows=size)
        cached = vectors[1, :count]  # a decode row's position is its count of cached tokens
        vectors[2] = scratch * layout.page_size
        vectors[2, :count] = table[np.arange(count), cached // layout.page_size] * layout.page_size
        vectors[2, :count] += cached % layout.page_size
        vectors[3] = 1
        vectors[3, :count] = cached + 1
        device = self.input_ids.device
        self.vectors[:, :size].copy_(to_device(vectors, device))
        self.page_table[:size, : table.shape[1]].copy_(to_device(table, device))
        if fill_input_ids is not None:
            fill_input_ids(self.input_ids[:count])
        key = GraphKey(GraphPhase.DECODE, size)
        self._graphs[key].replay()
        return self._logits[key][:count]
