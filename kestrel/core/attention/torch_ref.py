"""The torch reference backend: paged KV attention in plain PyTorch, on any device.

Decodes run as one padded batch; each prefill sequence runs on its own. It is the
correctness reference every other backend is tested against, float8 KV pools included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.core.attention.base import LATENT_KV, SEPARATE_KV, AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.paged import PagedAttentionBackend
from kestrel.core.metadata import DecodeMetadata, PrefillMetadata
from kestrel.core.state import FLOAT8_KV_DTYPES, KVLayerCache


class TorchReferenceBackend(PagedAttentionBackend):
    name = "torch"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        head_dims=None,
        sliding_window=True,
        cuda_graphs=False,
        page_sizes=None,
        kv_cache_dtypes=FLOAT8_KV_DTYPES,
        sinks=True,
        chunked_attention=True,
        kv_forms=frozenset({SEPARATE_KV, LATENT_KV}),
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
        sinks: torch.Tensor | None = None,
    ) -> None:
        output[: meta.num_seqs] = _decode_attention(query[: meta.num_seqs], cache, meta, layer, sinks)

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
        prefill_attention(query, cache, meta, layer, output, sinks)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes: torch has no CPU copy-by-index kernels for float8, and
    moving the bytes is the same copy."""
    return tensor.view(torch.uint8) if tensor.dtype in FLOAT8_KV_DTYPES else tensor


def store_kv(cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """key, value [tokens, kv_heads, dim] into their slots of the head-major pages (whatever
    their strides: KVLayerCache)."""
    page_size = cache.key.shape[2]
    store_kv_at(cache, key, value, slots // page_size, slots % page_size)


def store_kv_at(
    cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor
) -> None:
    """`store_kv` with each token's page and offset in it already split from its slot."""
    stored = ((cache.key, key),) if cache.values_in_keys else ((cache.key, key), (cache.value, value))
    for pool, new in stored:
        raw_bytes(pool)[:, pages, offsets] = raw_bytes(new.transpose(0, 1).to(pool.dtype))


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[heads, num_pages, page, dim] gathered by [rows, width] -> [rows, heads, width*page, dim],
    in `dtype` (default: the pool's own)."""
    gathered = raw_bytes(pages)[:, page_table].view(pages.dtype)
    heads, rows, width, page, dim = gathered.shape
    gathered = gathered.reshape(heads, rows, width * page, dim).transpose(0, 1)
    return gathered if dtype is None else gathered.to(dtype)


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with a boolean `mask`, and with `sinks` (shaped to
    broadcast against the query's leading dims, [..., queries]) as one more logit in each
    softmax: a key whose score is the sink and whose value is zero (GPT-OSS's sinks)."""
    if sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    bias = query.new_zeros((*query.shape[:-1], keys.shape[-2]), dtype=torch.float32)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[..., None].expand(*query.shape[:-1], 1)
    bias = torch.cat((bias, sink), dim=-1)
    zero = keys.new_zeros((*keys.shape[:-2], 1, keys.shape[-1]))
    keys, values = torch.cat((keys, zero), dim=-2), torch.cat((values, zero), dim=-2)
    bias = bias.to(query.dtype)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scale, enable_gqa=enable_gqa)


def grouped_sinks(sinks: torch.Tensor | None, layer: AttentionLayerSpec) -> torch.Tensor | None:
    """Per-head sinks laid out as a decode step groups its queries: [kv_heads, heads per KV head]."""
    if sinks is None:
        return None
    return sinks.view(layer.num_kv_heads, layer.num_heads // layer.num_kv_heads)


def _decode_attention(
    query: torch.Tensor,
    cache: KVLayerCache,
    meta: DecodeMetadata,
    layer: AttentionLayerSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    keys = gather_pages(cache.key, meta.page_table, query.dtype)
    values = gather_pages(cache.value, meta.page_table, query.dtype)
    mask = decode_key_mask(torch.arange(keys.shape[2], device=query.device), meta.seq_lens, layer)
    # The query heads sharing a KV head become that head's "query rows": one plain
    # attention per KV head, with no copy of K and V per query head.
    rows, group = query.shape[0], layer.num_heads // layer.num_kv_heads
    grouped = query.reshape(rows, layer.num_kv_heads, group, layer.head_dim)
    out = attention(grouped, keys, values, mask[:, None, None, :], layer.scale, grouped_sinks(sinks, layer))
    return out.reshape(rows, layer.num_heads, values.shape[-1])


def decode_key_mask(key_positions: torch.Tensor, seq_lens: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """[rows, keys]: which of the keys at `key_positions` each decode row (the last token of a
    sequence of `seq_lens` tokens) sees: its own sequence's, within the layer's window or chunk."""
    key_positions, seq_lens = key_positions[None, :], seq_lens[:, None]
    mask = key_positions < seq_lens
    if layer.sliding_window is not None:
        mask &= key_positions >= seq_lens - layer.sliding_window
    if layer.chunk_size is not None:  # the new token's chunk starts here
        mask &= key_positions >= (seq_lens - 1) // layer.chunk_size * layer.chunk_size
    return mask


def first_visible_key(seq_lens: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """[rows]: the first position each decode row sees (`decode_key_mask`'s first True; it may
    be negative where a window reaches past the sequence's start)."""
    first = torch.zeros_like(seq_lens)
    if layer.sliding_window is not None:
        first = torch.maximum(first, seq_lens - layer.sliding_window)
    if layer.chunk_size is not None:
        first = torch.maximum(first, (seq_lens - 1) // layer.chunk_size * layer.chunk_size)
    return first


def prefill_attention(
    query: torch.Tensor,
    cache: KVLayerCache,
    meta: PrefillMetadata,
    layer: AttentionLayerSpec,
    output: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    for index, (cached, seq_len) in enumerate(zip(meta.num_cached_tokens, meta.seq_lens)):
        start, end = meta.query_start_loc[index], meta.query_start_loc[index + 1]
        table = meta.page_table[index : index + 1]
        keys = gather_pages(cache.key, table, query.dtype)[:, :, :seq_len]
        values = gather_pages(cache.value, table, query.dtype)[:, :, :seq_len]
        query_positions = torch.arange(cached, seq_len, device=query.device)[:, None]
        key_positions = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_positions <= query_positions
        if layer.sliding_window is not None:
            mask &= key_positions > query_positions - layer.sliding_window
        if layer.chunk_size is not None:
            mask &= key_positions >= query_positions // layer.chunk_size * layer.chunk_size
        out = attention(
            query[start:end].transpose(0, 1)[None],
            keys,
            values,
            mask[None, None],
            layer.scale,
            sinks[:, None] if sinks is not None else None,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        output[start:end] = out[0].transpose(0, 1)
