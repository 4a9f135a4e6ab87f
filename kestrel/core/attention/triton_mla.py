"""The Triton backend for multi-head latent attention (DeepSeek's MLA) over a latent pool.

A latent pool holds one row per token and layer: the latent (`latent_dim` dims) followed by
the rotary key dims, shared by every query head; the values are the latents themselves
(`KVLayerCache.values_in_keys`). Decode (`mla_decode_kernel`): one program per (sequence,
block of query heads, split); each key block is read once for the block's heads, the scores
are latent and rotary dots summed, the weights multiply the same latent tile. Splits are
merged by the paged backend's `combine_splits`. Prefill runs the torch reference
(one attention per sequence over its gathered pages): correct, and outside the decode graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.core.attention.base import LATENT_KV, AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.torch_ref import prefill_attention as torch_prefill_attention
from kestrel.core.attention.torch_ref import raw_bytes
from kestrel.core.attention.triton_kernels import LOG2E, _softmax_step
from kestrel.core.attention.triton_paged import (
    TritonPagedBackend,
    combine_splits,
    decode_splits,
    page_size_of,
    split_partials,
)
from kestrel.core.metadata import DecodeMetadata, PrefillMetadata
from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs
from kestrel.core.state import FLOAT8_KV_DTYPES, KVLayerCache
from kestrel.core.workspace import Workspace

HEAD_BLOCK = 16  # query heads per program: tl.dot's smallest tile; DeepSeek-V3's 128 make 8 blocks
KEY_BLOCK = 32  # keys per step: a [32, 512] latent tile is 32 KB of bf16 shared memory


class TritonMlaBackend(TritonPagedBackend):
    name = "triton_mla"
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda"}),
        triton=True,
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        head_dims=None,  # latent + rotary dims, each padded to a power of two inside
        sliding_window=False,
        cuda_graphs=True,
        page_sizes=frozenset({16, 32, 64, 128}),
        kv_cache_dtypes=FLOAT8_KV_DTYPES,  # latents rounded to e4m3, widened as they are read
        kv_forms=frozenset({LATENT_KV}),
    )

    def store(self, cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """The new latent rows [tokens, 1, dim] into their slots (the values are in them)."""
        rows = cache.key.view(-1, cache.key.shape[-1])
        new = key.reshape(-1, rows.shape[-1]).to(rows.dtype)
        # As bytes: torch has no copy-by-index kernels for float8, and moving the bytes is the same copy.
        raw_bytes(rows).index_copy_(0, slots, raw_bytes(new))

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
        mla_decode_attention(query, cache, meta, layer, output, workspace=self._workspace)

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
        torch_prefill_attention(query, cache, meta, layer, output)


def _pad(dims: int) -> int:
    return max(16, triton.next_power_of_2(dims))


def mla_decode_attention(
    query: torch.Tensor,
    cache: KVLayerCache,
    meta: DecodeMetadata,
    layer: AttentionLayerSpec,
    output: torch.Tensor,
    num_splits: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """query [rows, heads, latent + rope] over the latent pool; output [rows, heads, latent].
    Splits as the paged backend's decode: by the batch's shape alone (graph-safe)."""
    latent, rope = layer.latent_dim, layer.head_dim - layer.latent_dim
    heads = layer.num_heads
    splits = num_splits or decode_splits(meta.num_seqs, triton.cdiv(heads, HEAD_BLOCK), query.device)
    partial_out = partial_lse = output  # unused without splits
    if splits > 1:
        partial_out, partial_lse = split_partials(workspace, query, meta.num_seqs, layer, splits, latent)
    keys = cache.key
    mla_decode_kernel[(meta.num_seqs, triton.cdiv(heads, HEAD_BLOCK), splits)](
        query,
        keys,
        output,
        meta.seq_lens,
        meta.page_table,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        keys.stride(1),
        keys.stride(2),
        meta.page_table.stride(0),
        partial_out,
        partial_lse,
        layer.scale,
        splits,
        heads,
        LATENT=latent,
        ROPE=rope,
        BLOCK_L=_pad(latent),
        BLOCK_R=_pad(rope),
        BLOCK_H=HEAD_BLOCK,
        PAGE=page_size_of(cache),
        BLOCK_N=KEY_BLOCK,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SPLIT=splits > 1,
        num_warps=4,
        num_stages=2,
        **dependent_launch_args(query.device),
    )
    if splits > 1:
        combine_splits(partial_out, partial_lse, output, meta.num_seqs, latent)


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(
    do_not_specialize=("stride_page_table", "num_splits"),
    do_not_specialize_on_alignment=("seq_lens_ptr", "page_table_ptr"),
)
def mla_decode_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    seq_lens_ptr,
    page_table_ptr,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_page,
    stride_cache_slot,
    stride_page_table,
    partial_out_ptr,
    partial_lse_ptr,
    scale,
    num_splits,
    num_heads,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One program per (sequence, block of BLOCK_H query heads, split): the heads' scores
    against each key block are latent . latent + rope . rope, and their weights multiply the
    latent tile already loaded for the scores."""
    wait_for_inputs(DEPENDENT)
    seq = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    latent_dims = tl.arange(0, BLOCK_L)
    rope_dims = tl.arange(0, BLOCK_R)
    latent_ok = (latent_dims < LATENT)[None, :]
    rope_ok = (rope_dims < ROPE)[None, :]
    query_rows = query_ptr + seq * stride_query_token + heads[:, None] * stride_query_head
    query_latent = tl.load(query_rows + latent_dims[None, :], mask=head_ok[:, None] & latent_ok, other=0.0)
    query_rope = tl.load(query_rows + LATENT + rope_dims[None, :], mask=head_ok[:, None] & rope_ok, other=0.0)
    scale = scale * LOG2E  # base-2 exponentials in the online softmax (triton_kernels._dot_query)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    blocks_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    begin = split * blocks_per_split * BLOCK_N
    end = tl.minimum(begin + blocks_per_split * BLOCK_N, seq_len)
    table_row = page_table_ptr + seq * stride_page_table
    for block_start in range(begin, end, BLOCK_N):
        positions = block_start + tl.arange(0, BLOCK_N)
        visible = positions < end
        pages = tl.load(table_row + positions // PAGE, mask=visible, other=0)
        rows = cache_ptr + pages[:, None] * stride_cache_page + (positions % PAGE)[:, None] * stride_cache_slot
        latents = tl.load(rows + latent_dims[None, :], mask=visible[:, None] & latent_ok, other=0.0)
        latents = latents.to(query_latent.dtype)
        key_rope = tl.load(rows + LATENT + rope_dims[None, :], mask=visible[:, None] & rope_ok, other=0.0)
        scores = tl.dot(query_latent, tl.trans(latents), input_precision=PRECISION)
        scores += tl.dot(query_rope, tl.trans(key_rope.to(query_rope.dtype)), input_precision=PRECISION)
        scores = tl.where(visible[None, :], scores.to(tl.float32) * scale, float("-inf"))
        weights, rescale, row_max, row_sum = _softmax_step(scores, row_max, row_sum)
        acc = acc * rescale[:, None]
        acc += tl.dot(weights.to(latents.dtype), latents, input_precision=PRECISION).to(tl.float32)
    seen = tl.where(row_sum == 0.0, 1.0, row_sum)  # an empty split saw nothing
    out = acc / seen[:, None]
    io_mask = head_ok[:, None] & latent_ok
    if SPLIT:  # partials [seq, head, split, latent] and [seq, head, split], as combine_splits_kernel reads
        partial = (seq * num_heads + heads) * num_splits + split
        empty = row_sum == 0.0
        lse = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))
        tl.store(partial_lse_ptr + partial, lse, mask=head_ok)
        tl.store(partial_out_ptr + partial[:, None] * LATENT + latent_dims[None, :], out, mask=io_mask)
    else:
        out_rows = out_ptr + seq * stride_out_token + heads[:, None] * stride_out_head
        tl.store(out_rows + latent_dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
