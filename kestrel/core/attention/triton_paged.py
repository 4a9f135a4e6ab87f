"""The Triton paged-attention backend (CUDA): store, decode and prefill kernels over the pool."""

from __future__ import annotations

import functools

import torch
import triton

from kestrel.core.attention.base import AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.paged import PagedAttentionBackend
from kestrel.core.attention.triton_kernels import (
    combine_splits_kernel,
    decode_kernel,
    prefill_kernel,
    store_kv_kernel,
)
from kestrel.core.metadata import DecodeMetadata, PrefillMetadata
from kestrel.core.runtime.dependent_launch import dependent_launch_args
from kestrel.core.state import FLOAT8_KV_DTYPES, KVLayerCache
from kestrel.core.workspace import Workspace

PREFILL_BLOCK_M = 64
# Prefill pipeline stages: against Triton's default of three, 276 us for 315 (bf16 pool) and
# 337 for 397 (float8), 8 fresh prompts of 1,000 tokens on the H200 (attention_bench --prefill).
PREFILL_STAGES = 2
KEY_BLOCK = 64  # keys per inner step: several small pages, or one page of 64 or more
LARGE_BATCH_KEY_BLOCK = 128  # decode_launch
# KV heads one store program writes: a program per (token, head) moved 256 bytes of a
# 128-wide head, tens of thousands of tiny programs per layer in a long prefill.
STORE_HEADS = 16
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows; smaller head groups are padded
MAX_DECODE_SPLITS = 16
INTERPRETER_MULTIPROCESSORS = 4  # CPU tensors (Triton's interpreter): small, so tests split


class TritonPagedBackend(PagedAttentionBackend):
    name = "triton"
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda"}),
        triton=True,
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        head_dims=frozenset({16, 32, 64, 80, 96, 128, 256}),  # tl.dot needs at least 16
        sliding_window=True,
        cuda_graphs=True,
        page_sizes=frozenset({16, 32, 64, 128}),
        kv_cache_dtypes=FLOAT8_KV_DTYPES,
        sinks=True,
        chunked_attention=True,
    )

    _workspace: Workspace | None = None

    def allocate(self, workspace: Workspace, max_rows: int, layer: AttentionLayerSpec) -> None:
        """The decode's split-K partials, once, for the largest batch."""
        reserve_split_partials(workspace, max_rows, layer)
        self._workspace = workspace

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
        decode_attention(query, cache, meta, layer, output, workspace=self._workspace, sinks=sinks)

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
        prefill_attention(query, cache, meta, layer, output, sinks=sinks)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def store_kv(cache: KVLayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    tokens, heads, head_dim = key.shape
    if tokens == 0:
        return
    per_program = min(STORE_HEADS, triton.next_power_of_2(heads))
    store_kv_kernel[(tokens, triton.cdiv(heads, per_program))](
        key,
        value,
        cache.key,
        cache.value,
        slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cache.key.stride(0),
        cache.key.stride(1),
        cache.key.stride(2),
        cache.value.stride(2),
        cache.value.stride(3),
        heads,
        PAGE=page_size_of(cache),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        HEADS=per_program,
        **dependent_launch_args(key.device),
    )


def _masks(layer: AttentionLayerSpec) -> tuple[int, int]:
    """The kernels' window and chunk arguments (0: none)."""
    return layer.sliding_window or 0, layer.chunk_size or 0


def _precision(query: torch.Tensor) -> str:
    # float32 models get exact float32 dots, not TF32; half types ignore this.
    return "ieee" if query.dtype == torch.float32 else "tf32"


def _dots_in_fp16(query: torch.Tensor, cache: KVLayerCache) -> bool:
    # A float8 pool widens exactly, and cheaply, to float16 (triton_kernels' docstring).
    return cache.key.dtype in FLOAT8_KV_DTYPES and query.dtype in (torch.bfloat16, torch.float16)


def decode_attention(
    query: torch.Tensor,
    cache: KVLayerCache,
    meta: DecodeMetadata,
    layer: AttentionLayerSpec,
    output: torch.Tensor,
    num_splits: int | None = None,
    workspace: Workspace | None = None,
    sinks: torch.Tensor | None = None,
    **launch: int,
) -> None:
    """`num_splits` (key splits per sequence) depends on the batch's shape only, never on
    its lengths, so a captured graph stays valid for every step of its bucket. The split
    partials come from `workspace` (reserved by `TritonPagedBackend.allocate`), else are
    allocated for this call. `launch` (num_warps, num_stages, BLOCK_N) overrides the
    defaults, for sweeps."""
    group = layer.num_heads // layer.num_kv_heads
    splits = num_splits or decode_splits(meta.num_seqs, layer.num_kv_heads, query.device)
    partial_out = partial_lse = output  # unused without splits
    if splits > 1:
        partial_out, partial_lse = split_partials(workspace, query, meta.num_seqs, layer, splits)
    constants = dict(
        GROUP=group,
        GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=layer.head_dim,
        BLOCK_D=_block_d(layer.head_dim),
        PAGE=page_size_of(cache),
        PRECISION=_precision(query),
        SPLIT=splits > 1,
        DOTS_IN_FP16=_dots_in_fp16(query, cache),
        VALUES_BY_SLOT=cache.values_by_slot,
        HAS_SINKS=sinks is not None,
        **dependent_launch_args(query.device),
    )
    constants.update(decode_launch(cache, layer.head_dim, splits))
    constants.update(launch)
    decode_kernel[(meta.num_seqs, layer.num_kv_heads, splits)](
        query,
        cache.key,
        cache.value,
        output,
        meta.seq_lens,
        meta.page_table,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        cache.key.stride(0),
        cache.key.stride(1),
        cache.key.stride(2),
        meta.page_table.stride(0),
        partial_out,
        partial_lse,
        query if sinks is None else sinks,  # any pointer where there are none
        layer.scale,
        *_masks(layer),
        splits,
        **constants,
    )
    if splits > 1:
        combine_splits(partial_out, partial_lse, output, meta.num_seqs, layer.head_dim)


_PARTIAL_OUT, _PARTIAL_LSE = "attention.decode.partial_out", "attention.decode.partial_lse"


def reserve_split_partials(workspace: Workspace, max_rows: int, layer: AttentionLayerSpec) -> None:
    """Room for the split partials of any decode batch of up to `max_rows` sequences."""
    rows = max(n * decode_splits(n, layer.num_kv_heads, workspace.device) for n in range(1, max_rows + 1))
    workspace.reserve(_PARTIAL_OUT, rows * layer.num_heads * layer.head_dim, torch.float32)
    workspace.reserve(_PARTIAL_LSE, rows * layer.num_heads, torch.float32)


def combine_splits(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, output: torch.Tensor, num_seqs: int, head_dim: int
) -> None:
    """Merge each (sequence, head)'s split partials (their outputs and log-sum-exps, as
    `split_partials` holds them) into `output` [tokens, heads, head_dim]; one launch."""
    heads, splits = output.shape[1], partial_lse.shape[-1]
    combine_splits_kernel[(num_seqs, heads)](
        partial_out,
        partial_lse,
        output,
        output.stride(0),
        output.stride(1),
        splits,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        SPLITS_PAD=triton.next_power_of_2(splits),
        **dependent_launch_args(output.device),
    )


def split_partials(
    workspace: Workspace | None,
    query: torch.Tensor,
    num_seqs: int,
    layer: AttentionLayerSpec,
    splits: int,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's output rows (`width` wide, by default the head's) and log-sum-exps."""
    shape = (num_seqs, layer.num_heads, splits)
    width = width or layer.head_dim
    if workspace is None:
        return query.new_empty((*shape, width), dtype=torch.float32), query.new_empty(shape, dtype=torch.float32)
    return workspace.get(_PARTIAL_OUT, (*shape, width), torch.float32), workspace.get(
        _PARTIAL_LSE, shape, torch.float32
    )


def decode_launch(cache: KVLayerCache, head_dim: int, splits: int) -> dict[str, int]:
    """Key block, warps, pipeline stages and loop shape of a decode launch. An unsplit batch
    (a large one) at head dims up to 128 takes 128-key blocks in two stages: 4-6% faster at
    256 sequences of 1,500 tokens on the H200 (scripts/attention_bench.py). Wider heads would
    not fit those blocks in shared memory; split batches keep smaller blocks so that short
    contexts still spread over their splits.

    Every key block is masked, in one loop (WHOLE_BLOCKS off): a first, unmasked loop over
    the whole blocks runs fewer instructions, yet timed no faster over a bf16 pool (361 us
    against 363) and slower over a float8 one (274 against 248), in calls of different days."""
    if splits == 1 and head_dim <= 128:
        # A float8 tile takes half the shared memory: room for a third stage (248 against 281 us).
        stages = 3 if cache.key.dtype in FLOAT8_KV_DTYPES else 2
        block = max(LARGE_BATCH_KEY_BLOCK, page_size_of(cache))
        return {"BLOCK_N": block, "num_warps": 4, "num_stages": stages, "WHOLE_BLOCKS": False}
    return {"BLOCK_N": key_block(cache), "WHOLE_BLOCKS": False}


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key splits per (sequence, kv head): enough programs to give every multiprocessor two,
    at most MAX_DECODE_SPLITS. Large batches fill the GPU unsplit and skip the combine."""
    programs = num_seqs * num_kv_heads
    return max(1, min(MAX_DECODE_SPLITS, 2 * multiprocessors(device) // programs))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefill_attention(
    query: torch.Tensor,
    cache: KVLayerCache,
    meta: PrefillMetadata,
    layer: AttentionLayerSpec,
    output: torch.Tensor,
    sinks: torch.Tensor | None = None,
    **launch: int,
) -> None:
    """`launch` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the defaults, for sweeps."""
    constants = dict(
        GROUP=layer.num_heads // layer.num_kv_heads,
        HEAD_DIM=layer.head_dim,
        BLOCK_D=_block_d(layer.head_dim),
        BLOCK_M=PREFILL_BLOCK_M,
        num_stages=PREFILL_STAGES,
        PAGE=page_size_of(cache),
        BLOCK_N=key_block(cache),
        PRECISION=_precision(query),
        DOTS_IN_FP16=_dots_in_fp16(query, cache),
        VALUES_BY_SLOT=cache.values_by_slot,
        HAS_SINKS=sinks is not None,
    )
    constants.update(launch)
    blocks = triton.cdiv(meta.max_query_len, constants["BLOCK_M"])
    prefill_kernel[(len(meta.seq_lens), layer.num_heads, blocks)](
        query,
        cache.key,
        cache.value,
        output,
        meta.query_start_loc_tensor,
        meta.num_cached_tokens_tensor,
        meta.page_table,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        cache.key.stride(0),
        cache.key.stride(1),
        cache.key.stride(2),
        meta.page_table.stride(0),
        query if sinks is None else sinks,
        layer.scale,
        *_masks(layer),
        **constants,
        **dependent_launch_args(query.device),
    )


def page_size_of(cache: KVLayerCache) -> int:
    return cache.key.shape[2]


def key_block(cache: KVLayerCache) -> int:
    return max(KEY_BLOCK, page_size_of(cache))
