"""The torch reference backend: paged KV attention in plain PyTorch, on any device.

Decodes run as one padded batch; each prefill sequence runs on its own. It is the
correctness reference every other backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.core.attention.base import AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.binding import PagedAttentionBackend
from kestrel.core.metadata import DecodeMetadata, PrefillMetadata
from kestrel.core.state import KVLayerCache


class TorchReferenceBackend(PagedAttentionBackend):
    name = "torch"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        head_dims=None,
        sliding_window=True,
        cuda_graphs=False,
        page_sizes=None,
    )

    def store(self, cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        store_kv(cache, key, value, slots)

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
        output[: meta.num_seqs] = _decode_attention(query[: meta.num_seqs], cache, meta, layer)

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
        prefill_attention(query, cache, meta, layer, output)


def store_kv(cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """key, value [tokens, kv_heads, dim] into their slots of the head-major pages."""
    heads, dim = key.shape[1], key.shape[2]
    cache.key.view(heads, -1, dim).index_copy_(1, slots, key.transpose(0, 1).to(cache.key.dtype))
    cache.value.view(heads, -1, dim).index_copy_(1, slots, value.transpose(0, 1).to(cache.value.dtype))


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """[heads, num_pages, page, dim] gathered by [rows, width] -> [rows, heads, width*page, dim]."""
    gathered = pages[:, page_table]
    heads, rows, width, page, dim = gathered.shape
    return gathered.view(heads, rows, width * page, dim).transpose(0, 1)


def _decode_attention(
    query: torch.Tensor, cache: KVLayerCache, meta: DecodeMetadata, layer: AttentionLayerSpec
) -> torch.Tensor:
    keys = gather_pages(cache.key, meta.page_table)
    values = gather_pages(cache.value, meta.page_table)
    key_positions = torch.arange(keys.shape[2], device=query.device)
    seq_lens = meta.seq_lens[:, None]
    mask = key_positions[None, :] < seq_lens
    if layer.sliding_window is not None:
        mask &= key_positions[None, :] >= seq_lens - layer.sliding_window
    # The query heads sharing a KV head become that head's "query rows": one plain
    # attention per KV head, with no copy of K and V per query head.
    rows, group = query.shape[0], layer.num_heads // layer.num_kv_heads
    grouped = query.reshape(rows, layer.num_kv_heads, group, layer.head_dim)
    out = F.scaled_dot_product_attention(
        grouped.to(keys.dtype), keys, values, attn_mask=mask[:, None, None, :], scale=layer.scale
    )
    return out.reshape(rows, layer.num_heads, layer.head_dim).to(query.dtype)


def prefill_attention(
    query: torch.Tensor,
    cache: KVLayerCache,
    meta: PrefillMetadata,
    layer: AttentionLayerSpec,
    output: torch.Tensor,
) -> None:
    for index, (cached, seq_len) in enumerate(zip(meta.num_cached_tokens, meta.seq_lens)):
        start, end = meta.query_start_loc[index], meta.query_start_loc[index + 1]
        table = meta.page_table[index : index + 1]
        keys = gather_pages(cache.key, table)[:, :, :seq_len]
        values = gather_pages(cache.value, table)[:, :, :seq_len]
        query_positions = torch.arange(cached, seq_len, device=query.device)[:, None]
        key_positions = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_positions <= query_positions
        if layer.sliding_window is not None:
            mask &= key_positions > query_positions - layer.sliding_window
        out = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None].to(keys.dtype),
            keys,
            values,
            attn_mask=mask[None, None],
            scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        output[start:end] = out[0].transpose(0, 1).to(query.dtype)
