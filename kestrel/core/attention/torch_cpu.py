"""The CPU backend: torch attention that avoids re-reading the paged pool every step.

On the CPU, attention over paged KV is bound by copying: the reference backend gathers every
decode sequence's pages into one contiguous batch on every step, which costs as much as the
attention itself. This backend keeps that gathered batch (a "decode mirror", one per layer)
from step to step and appends each step's new key and value to it; it gathers again only when
the decode batch changes (a sequence joins, leaves or is reordered). A fresh prefill attends
to its own new keys and values directly, with no gather at all.

It also joins compiled decode steps (the CPU runtime's graphs, `core/decode_graphs.py`)
through the graph hooks: there the mirrors are brought up to date before the step, outside
the compiled code (regathered when the batch changes), and the step appends to them and
attends over their first `width` keys, a dimension the compiled code takes as dynamic, so one
compilation serves every context length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kestrel.core.attention.base import AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.torch_ref import (
    TorchReferenceBackend,
    attention,
    decode_key_mask,
    first_visible_key,
    gather_pages,
    grouped_sinks,
    store_kv,
    store_kv_at,
)
from kestrel.core.batch import BatchLayout, SequenceChunk
from kestrel.core.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from kestrel.core.runtime import cpu_kernels
from kestrel.core.state import KVLayerCache, PagedKVProvider
from kestrel.core.workspace import Workspace

MIRROR_HEADROOM = 64  # tokens of room past the longest sequence, so appends rarely regather
MIRROR_MAX_LAYER_BYTES = 128 << 20  # above this a layer's decode batch is gathered each step
WIDTH_STEP = 16  # a compiled step attends over a multiple of this many keys


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


@dataclass(frozen=True)
class MirroredDecodeMetadata(DecodeMetadata):
    """A compiled decode step's metadata: the static buffers, and the positions of the keys
    its rows attend over in the mirrors (their count, the step's width, varies step to step)."""

    key_positions: torch.Tensor  # [width]


class CompiledMirrors:
    """The decode mirrors that compiled steps read: per layer [max_rows, kv_heads, capacity,
    dim]; a step of n rows uses the first n (a padded row sees its position 0 alone)."""

    def __init__(self, provider: PagedKVProvider, max_rows: int) -> None:
        self.caches = tuple(provider.layer(index) for index in range(provider.spec.num_layers))
        self.max_rows = max_rows
        self.page_size = provider.spec.page_size
        self._previous: DecodeBatch | None = None
        self._rows = 0
        self.step = -1  # the backend step they were last brought up to date for
        self._regather(torch.zeros((0, 0), dtype=torch.long), WIDTH_STEP + MIRROR_HEADROOM)
        self._set_width(WIDTH_STEP)

    def refresh(self, layout: BatchLayout, page_table: torch.Tensor, step: int) -> None:
        """Ready the mirrors for step `step`, which appends each row's new key at its last
        position: regathered from the pool (`page_table` [rows, pages], padded rows on the
        scratch page) unless the previous step was theirs and this one continues its batch
        within their capacity."""
        batch = DecodeBatch.of(layout.chunks)
        width = -(-max(batch.seq_lens) // WIDTH_STEP) * WIDTH_STEP
        current = (
            self.step == step - 1
            and self._rows == page_table.shape[0]
            and self._previous is not None
            and self._previous.continued_by(batch)
            and width <= self._capacity
        )
        if not current:
            self._regather(page_table, max(width + MIRROR_HEADROOM, page_table.shape[1] * self.page_size))
        self._previous, self.step = batch, step
        self._set_width(width)

    @torch.inference_mode()
    def _set_width(self, width: int) -> None:
        self.key_positions = self._all_positions[:width]
        torch._dynamo.mark_dynamic(self.key_positions, 0)

    @torch.inference_mode()  # as steps run: a compiled step's guards tell the two kinds apart
    def _regather(self, page_table: torch.Tensor, capacity: int) -> None:
        self._rows, self._capacity = page_table.shape[0], capacity
        self._all_positions = torch.arange(capacity)
        self.mirrors = [self._gather(cache, page_table, capacity) for cache in self.caches]

    def _gather(self, cache: KVLayerCache, page_table: torch.Tensor, capacity: int) -> DecodeMirror:
        """`page_table` [rows, pages]: each row's pages, as many as its longest needs."""
        shape = (self.max_rows, cache.key.shape[0], capacity, cache.key.shape[-1])
        # Zeros: masking multiplies by zero, which would keep a NaN that fresh memory held.
        mirror = DecodeMirror(cache.key.new_zeros(shape), cache.value.new_zeros(shape), 0)
        rows, width = page_table.shape[0], page_table.shape[1] * self.page_size
        if rows:
            mirror.key[:rows, :, :width] = gather_pages(cache.key, page_table)
            mirror.value[:rows, :, :width] = gather_pages(cache.value, page_table)
        for tensor in (mirror.key, mirror.value):
            torch._dynamo.mark_dynamic(tensor, 2)
        return mirror


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

    compiles = True
    # A compiled step's row reads its own mirror row, brought up to date before the step: a
    # verify chunk's later rows would miss the keys its earlier rows store in that step.
    graph_rows_see_each_other = False

    def __init__(self, device: torch.device, page_size: int) -> None:
        super().__init__(device, page_size)
        self._mirrors: dict[int, DecodeMirror] = {}  # by layer index
        self._step = 0
        self._previous: DecodeBatch | None = None
        self._continues = False  # whether this step's decode batch continues the previous one
        self._capacity = 0  # mirror length for this step's regathers
        self._index: _StepIndex | None = None  # this step's indices, shared by every layer
        self._compiled: CompiledMirrors | None = None  # compiled decode steps' mirrors
        self._native_kernels = cpu_kernels.available()  # asked once, outside any compiled step

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

    # ---- graph hooks: the base class's static buffers, and mirrors for compiled steps -------

    def prepare_capture(self, workspace: Workspace, provider: PagedKVProvider, max_rows: int, max_pages: int) -> None:
        super().prepare_capture(workspace, provider, max_rows, max_pages)
        self._compiled = CompiledMirrors(provider, max_rows)

    def capture_metadata(self, num_rows: int) -> AttentionMetadata:
        metadata = super().capture_metadata(num_rows)
        plain = metadata.decode
        decode = MirroredDecodeMetadata(
            plain.num_seqs, plain.seq_lens, plain.page_table, plain.max_seq_len, self._compiled.key_positions
        )
        return replace(metadata, decode=decode)

    def prepare_replay(self, layout: BatchLayout, num_rows: int) -> None:
        table = self._fill_graph_buffers(layout, num_rows)
        self._step += 1
        self._compiled.refresh(layout, torch.from_numpy(table), self._step)

    def _compiled_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVLayerCache,
        meta: MirroredDecodeMetadata,
        layer: AttentionLayerSpec,
        output: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> None:
        """Inside a compiled step: append each row's new key and value, attend over `width`."""
        mirror = self._compiled.mirrors[cache.layer_index]
        rows, width = meta.num_seqs, meta.key_positions.shape[0]
        every_row, positions = torch.arange(rows), meta.seq_lens - 1
        mirror.key[every_row, :, positions] = key[:rows].to(mirror.key.dtype)
        mirror.value[every_row, :, positions] = value[:rows].to(mirror.value.dtype)
        grouped = query[:rows].reshape(rows, layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim)
        if self._native_kernels and _kernel_attends(grouped, mirror):
            first = first_visible_key(meta.seq_lens[:rows], layer)
            row_sinks = grouped_sinks(sinks, layer)
            row_sinks = grouped.new_empty(0) if row_sinks is None else row_sinks.float().contiguous()
            out = cpu_kernels.ops().decode_attention(
                grouped.contiguous(), mirror.key, mirror.value, first, meta.seq_lens[:rows], layer.scale, row_sinks
            )
        else:
            mask = decode_key_mask(meta.key_positions, meta.seq_lens, layer)[:, None, None, :]
            keys, values = mirror.key[:rows, :, :width], mirror.value[:rows, :, :width]
            out = attention(grouped.to(keys.dtype), keys, values, mask, layer.scale, grouped_sinks(sinks, layer))
        output[:rows] = out.reshape(rows, layer.num_heads, mirror.value.shape[-1]).to(query.dtype)

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
        if not isinstance(metadata.decode, MirroredDecodeMetadata):
            return super().forward(query, key, value, cache, metadata, layer, sinks)
        store_kv(cache, key, value, metadata.slot_mapping)
        output = query.new_empty((*query.shape[:-1], value.shape[-1]))
        self._compiled_decode(query, key, value, cache, metadata.decode, layer, output, sinks)
        return output

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
    if layer.sliding_window is None and layer.chunk_size is None and bool((meta.seq_lens == width).all()):
        return None
    return decode_key_mask(torch.arange(width), meta.seq_lens, layer)[:, None, None, :]


def _kernel_attends(query: torch.Tensor, mirror: DecodeMirror) -> bool:
    """Whether Kestrel's CPU decode attention takes this step (float32, whole 16-wide vectors of
    head_dim), where torch's SDPA would spend most of its time setting up."""
    dims_fit = query.shape[-1] % 16 == 0 and mirror.value.shape[-1] == query.shape[-1]
    return dims_fit and query.dtype == mirror.key.dtype == torch.float32
