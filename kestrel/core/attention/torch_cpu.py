"""The CPU backend: torch attention that avoids re-reading the paged pool every step.

On the CPU, attention over paged KV is bound by copying: the reference backend gathers every
decode sequence's pages into one contiguous batch on every step, which costs as much as the
attention itself. This backend keeps that gathered batch (a "decode mirror", one per layer)
from step to step and appends each step's new key and value to it; it gathers again only when
the decode batch changes (a sequence joins, leaves or is reordered). A fresh prefill attends
to its own new keys and values directly, with no gather at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kestrel.core.attention.base import AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.torch_ref import (
    TorchReferenceBackend,
    attention,
    gather_pages,
    grouped_sinks,
    store_kv_at,
)
from kestrel.core.batch import BatchLayout, SequenceChunk
from kestrel.core.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from kestrel.core.state import KVLayerCache

MIRROR_HEADROOM = 64  # tokens of room past the longest sequence, so appends rarely regather
MIRROR_MAX_LAYER_BYTES = 128 << 20  # above this a layer's decode batch is gathered each step


@dataclass
class DecodeMirror:
    """One layer's contiguous copy of the decode batch's keys and values."""

    key: torch.Tensor  # [rows, kv_heads, capacity, head_dim]
    value: torch.Tensor
    step: int  # the step it was last brought up to date in


@dataclass
class _StepIndex:
    """What every layer of one step indexes by, computed once when the step is bound: each new
    token's page and offset, the decode rows' appended positions, and their masks (per window
    and width). A decode step of a 30-layer model otherwise rebuilt them 30 times."""

    slots: torch.Tensor  # the step's slot mapping, as bound
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    appended: tuple[torch.Tensor, torch.Tensor]  # (row, position) of each decode row's new token
    masks: dict[tuple[int | None, int | None, int], torch.Tensor | None]

    @classmethod
    def of(cls, metadata: AttentionMetadata, page_size: int) -> _StepIndex:
        slots = metadata.slot_mapping
        decode = metadata.decode
        rows = decode.num_seqs if decode is not None else 0
        seq_lens = decode.seq_lens if decode is not None else slots.new_zeros(0)
        appended = (torch.arange(rows), seq_lens - 1)
        return cls(slots, slots // page_size, slots % page_size, appended, {})

    def decode_mask(self, meta: DecodeMetadata, layer: AttentionLayerSpec, width: int) -> torch.Tensor | None:
        key = (layer.sliding_window, layer.chunk_size, width)
        if key not in self.masks:
            self.masks[key] = _decode_mask(meta, layer, width)
        return self.masks[key]


@dataclass(frozen=True)
class DecodeBatch:
    """Who was in a step's decode batch: enough to tell whether the next step continues it."""

    page_ids: tuple[tuple[int, ...], ...]
    seq_lens: tuple[int, ...]

    @classmethod
    def of(cls, chunks: tuple[SequenceChunk, ...]) -> DecodeBatch:
        return cls(tuple(c.page_ids for c in chunks), tuple(c.seq_len for c in chunks))

    def continued_by(self, later: DecodeBatch) -> bool:
        """Same sequences in the same rows, each exactly one token longer, on the same pages."""
        return (
            len(later.seq_lens) == len(self.seq_lens)
            and all(new == old + 1 for old, new in zip(self.seq_lens, later.seq_lens))
            and all(new[: len(old)] == old for old, new in zip(self.page_ids, later.page_ids))
        )


class TorchCpuBackend(TorchReferenceBackend):
    """The reference's store and cached-prefix prefill, with a mirrored decode and fresh prefills
    that skip the pool."""

    name = "torch_cpu"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        head_dims=None,
        sliding_window=True,
        cuda_graphs=False,
        page_sizes=None,
        sinks=True,
        chunked_attention=True,
    )

    def __init__(self, device: torch.device, page_size: int) -> None:
        super().__init__(device, page_size)
        self._mirrors: dict[int, DecodeMirror] = {}  # by layer index
        self._step = 0
        self._previous: DecodeBatch | None = None
        self._continues = False  # whether this step's decode batch continues the previous one
        self._capacity = 0  # mirror length for this step's regathers
        self._index: _StepIndex | None = None  # this step's indices, shared by every layer

    def bind(self, layout: BatchLayout) -> AttentionMetadata:
        self._step += 1
        decodes = DecodeBatch.of(layout.chunks[: layout.num_decodes])
        longest = max(decodes.seq_lens, default=0)
        self._continues = (
            self._previous is not None and self._previous.continued_by(decodes) and longest <= self._capacity
        )
        if not self._continues:
            self._capacity = longest + MIRROR_HEADROOM + (-longest) % self.page_size
        self._previous = decodes if decodes.seq_lens else None
        metadata = super().bind(layout)
        self._index = _StepIndex.of(metadata, self.page_size)
        return metadata

    def store(self, cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        if self._index is None or slots is not self._index.slots:
            super().store(cache, key, value, slots)
            return
        store_kv_at(cache, key, value, self._index.slot_pages, self._index.slot_offsets)

    def decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        meta: DecodeMetadata,
        layer: AttentionLayerSpec,
        output: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> None:
        rows = meta.num_seqs
        keys, values = self._decode_context(cache, key[:rows], value[:rows], meta)
        mask = self._index.decode_mask(meta, layer, keys.shape[2])
        rows_per_head = layer.num_heads // layer.num_kv_heads
        grouped = query[:rows].reshape(rows, layer.num_kv_heads, rows_per_head, layer.head_dim)
        out = attention(grouped.to(keys.dtype), keys, values, mask, layer.scale, grouped_sinks(sinks, layer))
        output[:rows] = out.reshape(rows, layer.num_heads, layer.head_dim).to(query.dtype)

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        meta: PrefillMetadata,
        layer: AttentionLayerSpec,
        output: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> None:
        special = layer.sliding_window is not None or layer.chunk_size is not None or sinks is not None
        if special or any(meta.num_cached_tokens):
            super().prefill(query, key, value, cache, meta, layer, output, sinks)
            return
        # Nothing cached: each sequence's context is exactly its new rows.
        for start, end in zip(meta.query_start_loc, meta.query_start_loc[1:]):
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1)[None],
                key[start:end].transpose(0, 1)[None].to(query.dtype),
                value[start:end].transpose(0, 1)[None].to(query.dtype),
                is_causal=True,
                scale=layer.scale,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            output[start:end] = out[0].transpose(0, 1)

    def _decode_context(
        self, cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, meta: DecodeMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, kv_heads, tokens, dim] keys and values covering every decode sequence."""
        rows, heads, dim = key.shape
        if 2 * rows * heads * self._capacity * dim * cache.key.element_size() > MIRROR_MAX_LAYER_BYTES:
            return gather_pages(cache.key, meta.page_table), gather_pages(cache.value, meta.page_table)
        layer_id = cache.layer_index
        mirror = self._mirrors.get(layer_id)
        if self._continues and mirror is not None and mirror.step == self._step - 1:
            every_row, positions = self._index.appended
            mirror.key[every_row, :, positions] = key.to(mirror.key.dtype)
            mirror.value[every_row, :, positions] = value.to(mirror.value.dtype)
        else:
            mirror = self._regather(cache, meta, rows, heads, dim)
            self._mirrors[layer_id] = mirror
        mirror.step = self._step
        return mirror.key[:, :, : meta.max_seq_len], mirror.value[:, :, : meta.max_seq_len]

    def _regather(self, cache: KVLayerCache, meta: DecodeMetadata, rows: int, heads: int, dim: int) -> DecodeMirror:
        shape = (rows, heads, self._capacity, dim)
        # Zeros: a shorter row's unused tail is masked, and masking multiplies by zero, which
        # would keep any NaN that uninitialised memory held.
        mirror = DecodeMirror(cache.key.new_zeros(shape), cache.value.new_zeros(shape), self._step)
        width = meta.page_table.shape[1] * self.page_size
        mirror.key[:, :, :width] = gather_pages(cache.key, meta.page_table)
        mirror.value[:, :, :width] = gather_pages(cache.value, meta.page_table)
        return mirror


def _decode_mask(meta: DecodeMetadata, layer: AttentionLayerSpec, width: int) -> torch.Tensor | None:
    """Which keys each decode row may see; None when every row sees all `width` of them."""
    seq_lens = meta.seq_lens[:, None]
    key_positions = torch.arange(width)[None, :]
    if layer.sliding_window is None and layer.chunk_size is None and bool((seq_lens == width).all()):
        return None
    mask = key_positions < seq_lens
    if layer.sliding_window is not None:
        mask &= key_positions >= seq_lens - layer.sliding_window
    if layer.chunk_size is not None:  # the new token's chunk starts here
        mask &= key_positions >= (seq_lens - 1) // layer.chunk_size * layer.chunk_size
    return mask[:, None, None, :]
