"""Decode attention alone on a GPU: a full batch of long contexts over a bf16 pool and over a
float8 pool (Llama-3-8B heads), as KV bytes read per second, for Triton's default launch and
a sweep of warps, pipeline stages, key blocks and key splits.

    python scripts/attention_bench.py [--batch 256] [--context 1500] [--quick]

`--quick` times only the default launch, with the default key splits, and the same with the
whole key blocks read in a loop of their own, unmasked (WHOLE_BLOCKS). `--float8-stages`
sweeps the float8 pool alone over deeper pipelines (its tiles take half the shared memory),
fewer warps (one warp holds a whole tile: no exchange between warps in each block) and both
loop shapes.
`--prefill` times the prefill kernel instead: `--prefill-seqs` fresh prompts of `--context`
tokens (causal), in TFLOP/s, over query blocks, key blocks, warps and stages.
`--overlap` times, for one Llama-3-8B layer at `--batch` rows, the decode attention over a
float8 pool and the layer's four projections (float8 weights, then bf16), each alone and then
on two streams at once in one graph: whether a step's memory-bound attention could run beside
its compute-bound matmuls (two half-batches a layer apart) and save the time of the shorter.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.attention.triton_paged import decode_attention, prefill_attention
from kestrel.core.metadata import DecodeMetadata, PrefillMetadata
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
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    if args.overlap:
        return overlap(args.batch, args.context)
    if args.prefill:
        return prefill_sweep(args.prefill_seqs, args.context, args.quick)
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    query = torch.randn(args.batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    output = torch.empty_like(query)
    launches = [{}] + [
        {"num_warps": w, "num_stages": s, "BLOCK_N": n} for w in (4, 8) for s in (1, 2) for n in (32, 64, 128)
    ]
    splits_tried = (None, 1, 2, 4)  # None: the default for the batch
    dtypes = (torch.bfloat16, torch.float8_e4m3fn)
    if args.quick:  # the default launch, then with the whole key blocks in an unmasked loop
        launches, splits_tried = [{}, {"WHOLE_BLOCKS": True}], (None,)
    if args.float8_stages:  # unsplit: two splits timed 266-470 us against 248 unsplit
        dtypes, splits_tried = (torch.float8_e4m3fn,), (None,)
        launches = [{}] + [
            {"num_warps": w, "num_stages": s, "BLOCK_N": n, "WHOLE_BLOCKS": whole}
            for w in (1, 2, 4)
            for s in (2, 3, 4)
            for n in (64, 128)
            for whole in (False, True)
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
    return milliseconds_per_call(lambda: decode_attention(query, kv.layer(0), meta, layer, output, splits, **launch))


def milliseconds_per_call(call, repeats: int = 20) -> float:
    """Device time per call: `repeats` calls captured in one CUDA graph and replayed, so a
    small launch (batch 1) is not timed as the host's launch overhead."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


LLAMA_PROJECTIONS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # qkv, o, gate/up, down


def overlap(batch: int, context: int) -> None:
    from kestrel.layers.fp8_matmul import fp8_linear
    from kestrel.layers.quantized import quantize_fp8

    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    query = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    output = torch.empty_like(query)
    kv, meta = pool(torch.float8_e4m3fn, batch, context)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for n, k in LLAMA_PROJECTIONS]
    float8 = [quantize_fp8(weight) for weight in weights]
    inputs = [torch.randn(batch, k, device="cuda", dtype=torch.bfloat16) for _, k in LLAMA_PROJECTIONS]

    def attention():
        decode_attention(query, kv.layer(0), meta, layer, output)

    def float8_matmuls():
        for x, weight in zip(inputs, float8):
            fp8_linear(x, weight.values, weight.scales)

    def bf16_matmuls():
        for x, weight in zip(inputs, weights):
            torch.mm(x, weight.t())

    side = torch.cuda.Stream()
    alone = milliseconds_per_call(attention)
    print(f"attention alone, float8 pool, {batch} x {context}: {alone * 1e3:.1f} us")
    for name, matmuls in (("float8", float8_matmuls), ("bf16", bf16_matmuls)):
        matmul_alone = milliseconds_per_call(matmuls)
        together = milliseconds_per_call(lambda matmuls=matmuls: on_two_streams(attention, matmuls, side))
        print(
            f"{name} projections alone {matmul_alone * 1e3:.1f} us; both one after the other "
            f"{(alone + matmul_alone) * 1e3:.1f} us; on two streams {together * 1e3:.1f} us "
            f"(saves {(alone + matmul_alone - together) * 1e3:.1f} us of the shorter's "
            f"{min(alone, matmul_alone) * 1e3:.1f})"
        )


def on_two_streams(first, second, side: torch.cuda.Stream) -> None:
    """`first` on the current stream and `second` on the `side` stream, both after what came
    before and both done before what comes after (the fork and join a graph captures)."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second()
    first()
    torch.cuda.current_stream().wait_stream(side)


def prefill_sweep(seqs: int, length: int, quick: bool) -> None:
    """Fresh prompts (nothing cached), as a throughput run's prefill steps take them."""
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    query = torch.randn(seqs * length, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    output = torch.empty_like(query)
    starts = [index * length for index in range(seqs + 1)]
    flops = seqs * 4 * HEADS * HEAD_DIM * length * (length + 1) / 2  # causal: half the scores
    launches = [{}]
    if not quick:
        launches += [
            {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
            for m in (64, 128)
            for n in (32, 64, 128)
            for w in (4, 8)
            for s in (2, 3)
        ]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        kv, decode = pool(dtype, seqs, length)
        meta = PrefillMetadata(
            query_start_loc=tuple(starts),
            num_cached_tokens=(0,) * seqs,
            seq_lens=(length,) * seqs,
            page_table=decode.page_table,
            query_start_loc_tensor=torch.tensor(starts, device="cuda"),
            num_cached_tokens_tensor=torch.zeros(seqs, dtype=torch.long, device="cuda"),
            max_query_len=length,
        )
        for launch in launches:
            try:
                call = functools.partial(prefill_attention, query, kv.layer(0), meta, layer, output, **launch)
                ms = milliseconds_per_call(call)
            except Exception as error:  # e.g. out of shared memory: reported, and the sweep goes on
                print(f"{str(dtype):<22}{launch}: {type(error).__name__}")
                continue
            print(f"{str(dtype):<22}{str(launch):<70}{ms * 1e3:>9.1f} us {flops / ms / 1e9:>8.1f} TFLOP/s")


if __name__ == "__main__":
    main()
