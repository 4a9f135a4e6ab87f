"""CUDA graphs for decode steps: static buffers, buckets captured largest first into one
memory pool, padding to the bucket, and replay keyed by `GraphKey`.

Padded rows decode one throwaway token: they write to the pool's scratch page and attend
to it alone, so they touch no request's state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kestrel.core.attention.base import AttentionBackend
from kestrel.core.batch import BatchLayout
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

        self.input_ids, self.positions, self.slots = buffer(largest), buffer(largest), buffer(largest)
        self.seq_lens = buffer(largest)
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
        self._fill_padding(0, self.buckets[-1])
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

    def _fill_padding(self, start: int, stop: int) -> None:
        scratch = self.kv.scratch_page
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slots[start:stop] = scratch * self.kv.spec.page_size
        self.seq_lens[start:stop] = 1
        self.page_table[start:stop, 0] = scratch

    def run(self, layout: BatchLayout, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only step, by replaying the bucket's graph."""
        count = len(layout.chunks)
        size = self.bucket_for(count)
        page_size = layout.page_size
        width = max(len(chunk.page_ids) for chunk in layout.chunks)
        table = [list(c.page_ids) + [self.kv.scratch_page] * (width - len(c.page_ids)) for c in layout.chunks]
        slots = [
            c.page_ids[c.num_cached_tokens // page_size] * page_size + c.num_cached_tokens % page_size
            for c in layout.chunks
        ]
        host = torch.tensor([list(token_ids), list(positions), slots, [c.seq_len for c in layout.chunks]])
        device = self.input_ids.device
        self.input_ids[:count].copy_(host[0], non_blocking=True)
        self.positions[:count].copy_(host[1], non_blocking=True)
        self.slots[:count].copy_(host[2], non_blocking=True)
        self.seq_lens[:count].copy_(host[3], non_blocking=True)
        self.page_table[:count, :width].copy_(torch.tensor(table).to(device, non_blocking=True))
        self._fill_padding(count, size)
        key = GraphKey(GraphPhase.DECODE, size)
        self._graphs[key].replay()
        return self._logits[key][:count]
