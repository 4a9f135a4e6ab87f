"""Decode attention alone on a GPU: a full batch of long contexts over a bf16 pool and over a
float8 pool (Llama-3-8B heads), as KV bytes read per second, for Triton's default launch and
a sweep of warps, pipeline stages, key blocks and key splits.

    python scripts/attention_bench.py [--batch 256] [--context 1500] [--quick]

`--quick` times only the default launch, with the default key splits. `--float8-stages`
sweeps the float8 pool alone over deeper pipelines (its tiles take half the shared memory).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.attention.triton_paged import decode_attention
from kestrel.core.metadata import DecodeMetadata
from kestrel.core.state import KVCacheSpec, PagedKVProvider

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def pool(
    dtype: torch.dtype, batch: int, context: int, pool_pages: int | None = None, interleaved: bool = False
) -> tuple[PagedKVProvider, DecodeMetadata]:
    """A pool of `pool_pages` (default: just the batch's) filled with noise, and the batch's
    page table: pages drawn at random, or `interleaved` as an engine hands them out when the
    whole batch grows a page each step (page i of sequence s is page i * batch + s)."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, page_size=PAGE)
    pages_per_seq = -(-context // PAGE)
    used = batch * pages_per_seq
    kv = PagedKVProvider(spec, max(used, pool_pages or 0) * spec.bytes_per_page(), torch.device("cuda"))
    for layer in (kv.layer(0).key, kv.layer(0).value):
        layer.copy_(torch.randn(layer.shape, device="cuda").to(dtype))
    if interleaved:
        table = torch.arange(used, device="cuda", dtype=torch.int32).view(pages_per_seq, batch).t().contiguous()
    else:
        table = torch.randperm(used, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return kv, DecodeMetadata(num_seqs=batch, seq_lens=seq_lens, page_table=table, max_seq_len=context)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--float8-stages", action="store_true")
    parser.add_argument("--pool-pages", type=int, default=None, help="pool size in pages (default: the batch's)")
    parser.add_argument("--interleaved", action="store_true", help="pages as an engine hands them out")
    args = parser.parse_args()
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    query = torch.randn(args.batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    output = torch.empty_like(query)
    launches = [{}] + [
        {"num_warps": w, "num_stages": s, "BLOCK_N": n} for w in (4, 8) for s in (1, 2) for n in (32, 64, 128)
    ]
    splits_tried = (None, 1, 2, 4)  # None: the default for the batch
    dtypes = (torch.bfloat16, torch.float8_e4m3fn)
    if args.quick:
        launches, splits_tried = [{}], (None,)
    if args.float8_stages:
        dtypes, splits_tried = (torch.float8_e4m3fn,), (None, 2)
        launches = [{}] + [
            {"num_warps": w, "num_stages": s, "BLOCK_N": n} for w in (4, 8) for s in (2, 3, 4) for n in (64, 128)
        ]
    for dtype in dtypes:
        kv, meta = pool(dtype, args.batch, args.context, args.pool_pages, args.interleaved)
        kv_bytes = 2 * args.batch * args.context * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
        for launch, splits in itertools.product(launches, splits_tried):
            try:
                milliseconds = time_decode(query, kv, meta, layer, output, launch, splits)
            except Exception as error:  # e.g. out of shared memory: reported, and the sweep goes on
                print(f"{str(dtype):<22}{launch} splits={splits}: {type(error).__name__}")
                continue
            rate = kv_bytes / milliseconds / 1e9
            setting = f"{launch} splits={splits}"
            print(f"{str(dtype):<22}{setting:<60}{milliseconds * 1e3:>9.1f} us {rate:>8.2f} TB/s")


def time_decode(query, kv, meta, layer, output, launch: dict, splits: int | None) -> float:
    for _ in range(3):
        decode_attention(query, kv.layer(0), meta, layer, output, splits, **launch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        decode_attention(query, kv.layer(0), meta, layer, output, splits, **launch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20


if __name__ == "__main__":
    main()
