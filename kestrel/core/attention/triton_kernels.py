"""Triton kernels over the head-major paged KV pool ([kv_heads, pages, page_size, head_dim]).

- `store_kv_kernel`: one program per token (and up to 16 kv heads) writes the new key and
  value rows.
- `decode_kernel`: one program per (sequence, kv head, split); the GROUP query heads sharing
  that KV head are the rows of one tile, so each KV page is read once per head group. Keys
  are taken BLOCK_N at a time, across several pages, so each step does a sizeable dot. When
  a batch has too few (sequence, kv head) pairs to fill the GPU, the keys are split across
  programs (flash-decoding) and `combine_splits_kernel` merges their partial softmaxes.
- `prefill_kernel`: one program per (sequence, query head, block of query rows), the last
  blocks first; walks the sequence's pages (cached prefix and new tokens alike) with
  causal and window masks.
Both attention kernels use an online softmax (FlashAttention-style) in float32. The store
and decode kernels may be launched as dependent (core/runtime/dependent_launch.py).

The pool may hold a narrower dtype than the model (float8 e4m3): keys and values are cast on
the way in and widened as they are read. A half-precision model then takes its dots in
float16 (`DOTS_IN_FP16`): float8 widens to float16 exactly and in one instruction per pair,
while widening to bfloat16 takes several, which made reading the float8 pool as slow as
reading a pool twice its size. The query is scaled before its narrowing, so its range is
the scores' range.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kestrel.core.runtime.dependent_launch import wait_for_inputs

LOG2E = tl.constexpr(1.4426950408889634)


# The slot mapping is a per-step array (a row of the graphs' buffer, or its own tensor).
@triton.jit(do_not_specialize_on_alignment=("slot_ptr",))
def store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_head,
    stride_cache_page,
    stride_key_cache_slot,
    stride_value_cache_slot,
    stride_value_cache_dim,
    num_heads,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """Each token's key and value rows, HEADS kv heads per program, into the token's slot; a
    pool's values may be stored slot-minor (KVLayerCache), hence their own strides."""
    wait_for_inputs(DEPENDENT)
    token = tl.program_id(0)
    heads = (tl.program_id(1) * HEADS + tl.arange(0, HEADS))[:, None]
    slot = tl.load(slot_ptr + token)
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    page_start = heads * stride_cache_head + slot // PAGE * stride_cache_page
    in_page = slot % PAGE
    key_target = page_start + in_page * stride_key_cache_slot + dims
    value_target = page_start + in_page * stride_value_cache_slot + dims * stride_value_cache_dim
    # Through float32: half types have no direct conversion to float8 everywhere.
    tl.store(key_cache_ptr + key_target, key.to(tl.float32).to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + value_target, value.to(tl.float32).to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot_query(query, scale, DOTS_IN_FP16: tl.constexpr):
    """The query as the dots take it, and the factor still to apply to their scores: the
    softmax scale times log2(e), so that the online softmax takes base-2 exponentials (one
    multiply fewer per score than `tl.exp`, which scales its argument by log2(e) itself)."""
    scale = scale * LOG2E
    # One return: Triton requires every return of a function to give the same types.
    if DOTS_IN_FP16:
        query = (query.to(tl.float32) * scale).to(tl.float16)
        scale = 1.0
    return query, scale


@triton.jit
def _block_pages(
    page_table_row_ptr,
    positions,
    end,
    kv_head,
    stride_cache_head,
    stride_cache_page,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Where each position's page starts in the pool, its slot there, and whether the page is
    one the sequence uses up to `end` (every slot of it: values may be read by whole pages).
    MASKED, only those pages are looked up (the others read page 0); unmasked, every
    position is known to be in use."""
    page_in_use = positions // PAGE < tl.cdiv(end, PAGE)
    if MASKED:
        pages = tl.load(page_table_row_ptr + positions // PAGE, mask=page_in_use, other=0)
    else:
        pages = tl.load(page_table_row_ptr + positions // PAGE)
    return kv_head * stride_cache_head + pages * stride_cache_page, positions % PAGE, page_in_use


@triton.jit
def _load_values_by_slot(value_cache_ptr, page_starts, in_page, dims, mask, PAGE: tl.constexpr, RUN: tl.constexpr):
    """A [keys, dims] tile of a pool whose pages hold values slot-minor ([dim, slot]), `mask`
    whole pages: each run of RUN keys (within one page) is then one vector load."""
    offsets = page_starts + in_page + dims[None, :] * PAGE
    offsets = tl.max_contiguous(tl.multiple_of(offsets, [RUN, 1]), [RUN, 1])
    return tl.load(value_cache_ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _softmax_step(scores, row_max, row_sum):
    """One online-softmax step over `scores` [rows, keys], in base 2 (scores carry the
    factor log2(e)): the weights, the factor that rescales what was accumulated before,
    and the new running max and sum."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    # Rows that have seen nothing visible yet keep a max of -inf; subtract 0 there, not -inf.
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(row_max - safe_max)
    weights = tl.exp2(scores - safe_max[:, None])
    return weights, rescale, new_max, row_sum * rescale + tl.sum(weights, 1)


@triton.jit
def _attend_range(
    first,
    stop,
    query,
    acc,
    row_max,
    row_sum,
    key_cache_ptr,
    value_cache_ptr,
    page_table_row_ptr,
    query_positions,
    end,
    window,
    chunk,
    kv_head,
    scale,
    stride_cache_head,
    stride_cache_page,
    stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    VALUES_BY_SLOT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online-softmax updates of `acc` with the key blocks from `first` to `stop`, which
    may span several pages (looked up in the sequence's page-table row). Rows are queries
    at `query_positions`, seeing keys before `end`, causally, within `window` (0: no
    window) and within their own `chunk` of positions (0: no chunks). Unless MASKED, every
    key of every block is visible to every row: no masks, which cost as many instructions
    per block as the dots' own work."""
    dims = tl.arange(0, BLOCK_D)
    in_dim = (dims < HEAD_DIM)[None, :]
    for block_start in range(first, stop, BLOCK_N):
        positions = block_start + tl.arange(0, BLOCK_N)
        page_starts, in_page, page_in_use = _block_pages(
            page_table_row_ptr, positions, end, kv_head, stride_cache_head, stride_cache_page, PAGE, MASKED
        )
        offsets = page_starts[:, None] + in_page[:, None] * stride_cache_slot + dims[None, :]
        in_sequence = positions < end
        key_mask = in_sequence[:, None] & in_dim if MASKED else in_dim
        keys = tl.load(key_cache_ptr + offsets, mask=key_mask, other=0.0).to(query.dtype)
        if VALUES_BY_SLOT:
            value_mask = page_in_use[:, None] & in_dim if MASKED else in_dim  # whole pages: vector loads
            values = _load_values_by_slot(
                value_cache_ptr, page_starts[:, None], in_page[:, None], dims, value_mask, PAGE, min(PAGE, BLOCK_N)
            )
        else:
            values = tl.load(value_cache_ptr + offsets, mask=key_mask, other=0.0)
        values = values.to(query.dtype)
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION).to(tl.float32) * scale
        if MASKED:
            causal = positions[None, :] <= query_positions[:, None]
            in_window = (window == 0) | (positions[None, :] > query_positions[:, None] - window)
            chunk_start = query_positions // tl.maximum(chunk, 1) * chunk  # 0 without chunks
            in_chunk = positions[None, :] >= chunk_start[:, None]
            scores = tl.where(causal & in_window & in_chunk & in_sequence[None, :], scores, float("-inf"))
        weights, rescale, row_max, row_sum = _softmax_step(scores, row_max, row_sum)
        acc = acc * rescale[:, None]
        acc += tl.dot(weights.to(values.dtype), values, input_precision=PRECISION).to(tl.float32)
    return acc, row_max, row_sum


# Values and per-step arrays (whose alignment varies) that change from step to step: a
# compiled variant for each would stall serving.
@triton.jit(
    do_not_specialize=("stride_page_table", "num_splits"),
    do_not_specialize_on_alignment=("seq_lens_ptr", "page_table_ptr"),
)
def decode_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    seq_lens_ptr,
    page_table_ptr,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_head,
    stride_cache_page,
    stride_cache_slot,
    stride_page_table,
    partial_out_ptr,
    partial_lse_ptr,
    sinks_ptr,
    scale,
    window,
    chunk,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    DOTS_IN_FP16: tl.constexpr,
    VALUES_BY_SLOT: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """`sinks` (HAS_SINKS): a logit per query head in each softmax, with no value (GPT-OSS);
    counted by the first split alone, so that combining the splits counts it once."""
    wait_for_inputs(DEPENDENT)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    io_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + rows
    query = tl.load(
        query_ptr + seq * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    query, scale = _dot_query(query, scale, DOTS_IN_FP16)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)
    row_max = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        row_max = tl.where(split == 0, sink, row_max)
        row_sum = tl.where(split == 0, 1.0, row_sum)
    first_position = seq_len * 0  # same integer type as the loaded lengths
    if window > 0:
        first_position = tl.maximum(seq_len - window, 0)
    if chunk > 0:  # the newest token's chunk
        first_position = (seq_len - 1) // chunk * chunk
    table_row = page_table_ptr + seq * stride_page_table
    # This program's share of the key blocks: whole blocks, the later splits possibly empty.
    first_block = first_position // BLOCK_N * BLOCK_N
    blocks_per_split = tl.cdiv(tl.cdiv(seq_len - first_block, BLOCK_N), num_splits)
    begin = first_block + split * blocks_per_split * BLOCK_N
    end = tl.minimum(begin + blocks_per_split * BLOCK_N, seq_len)
    # WHOLE_BLOCKS: the whole blocks of a window-less sequence, visible to every row, are
    # read first, without masks; else every block is masked, in one loop.
    whole_end = begin
    if WHOLE_BLOCKS:
        whole_blocks = tl.maximum(end - begin, 0) // BLOCK_N  # an empty split: none
        whole_end = tl.where((window == 0) & (chunk == 0), begin + whole_blocks * BLOCK_N, begin)
    query_positions = seq_len - 1 + rows * 0  # every row's query is the newest token
    for masked in tl.static_range(1 - WHOLE_BLOCKS, 2):  # the whole blocks, then the edge one
        acc, row_max, row_sum = _attend_range(
            whole_end if masked else begin,
            end if masked else whole_end,
            query,
            acc,
            row_max,
            row_sum,
            key_cache_ptr,
            value_cache_ptr,
            table_row,
            query_positions,
            end,
            window,
            chunk,
            kv_head,
            scale,
            stride_cache_head,
            stride_cache_page,
            stride_cache_slot,
            HEAD_DIM,
            BLOCK_D,
            PAGE,
            BLOCK_N,
            PRECISION,
            VALUES_BY_SLOT,
            masked == 1,
        )
    seen = tl.where(row_sum == 0.0, 1.0, row_sum)  # padded rows saw nothing
    out = acc / seen[:, None]
    if SPLIT:  # partial results, [seq, head, split, dim] and [seq, head, split], for combining
        partial = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        empty = row_sum == 0.0
        lse = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))  # base 2
        tl.store(partial_lse_ptr + partial, lse, mask=row_ok)
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], out, mask=io_mask)
    else:
        tl.store(
            out_ptr + seq * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("num_splits",))
def combine_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_out_token,
    stride_out_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One program per (sequence, query head): the splits' outputs weighted by their share
    of the softmax mass (2 to the power of each split's base-2 log-sum-exp)."""
    wait_for_inputs(DEPENDENT)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    in_split = splits < num_splits
    first = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(partial_lse_ptr + first + splits, mask=in_split, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
    mask = in_split[:, None] & (dims < HEAD_DIM)[None, :]
    parts = tl.load(partial_out_ptr + (first + splits)[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# Values and per-step arrays (whose alignment varies) that change from step to step: a
# compiled variant for each would stall serving.
@triton.jit(
    do_not_specialize=("stride_page_table",),
    do_not_specialize_on_alignment=("query_start_ptr", "num_cached_ptr", "page_table_ptr"),
)
def prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    query_start_ptr,
    num_cached_ptr,
    page_table_ptr,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_head,
    stride_cache_page,
    stride_cache_slot,
    stride_page_table,
    sinks_ptr,
    scale,
    window,
    chunk,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOTS_IN_FP16: tl.constexpr,
    VALUES_BY_SLOT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    wait_for_inputs(DEPENDENT)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # Later query blocks see more keys: launched first, the longest programs do not trail.
    block = tl.num_programs(2) - 1 - tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if block * BLOCK_M >= query_len:
        return
    cached = tl.load(num_cached_ptr + seq)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    io_mask = (rows < query_len)[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(
        query_ptr + (query_start + rows)[:, None] * stride_query_token + head * stride_query_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    query, scale = _dot_query(query, scale, DOTS_IN_FP16)
    query_positions = cached + rows
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_SINKS:  # the head's sink logit: one more term of every row's softmax, with no value
        row_max = tl.full((BLOCK_M,), 1.0, dtype=tl.float32) * (tl.load(sinks_ptr + head).to(tl.float32) * LOG2E)
        row_sum = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    end = cached + tl.minimum((block + 1) * BLOCK_M, query_len)  # the block's last query position + 1
    first_position = cached * 0  # same integer type as the loaded lengths
    if window > 0:
        first_position = tl.maximum(cached + block * BLOCK_M - window + 1, 0)
    if chunk > 0:  # the first row's chunk
        first_position = (cached + block * BLOCK_M) // chunk * chunk
    kv_head = head // GROUP
    table_row = page_table_ptr + seq * stride_page_table
    first = first_position // BLOCK_N * BLOCK_N
    # Key blocks wholly at or before the first row's position are visible to every row
    # (without a window): no masks there.
    whole_end = (cached + block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    if (window > 0) | (chunk > 0):
        whole_end = first
    for masked in tl.static_range(2):  # the whole blocks, then the diagonal ones
        acc, row_max, row_sum = _attend_range(
            whole_end if masked else first,
            end if masked else whole_end,
            query,
            acc,
            row_max,
            row_sum,
            key_cache_ptr,
            value_cache_ptr,
            table_row,
            query_positions,
            end,
            window,
            chunk,
            kv_head,
            scale,
            stride_cache_head,
            stride_cache_page,
            stride_cache_slot,
            HEAD_DIM,
            BLOCK_D,
            PAGE,
            BLOCK_N,
            PRECISION,
            VALUES_BY_SLOT,
            masked == 1,
        )
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # padded rows saw nothing
    tl.store(
        out_ptr + (query_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )
