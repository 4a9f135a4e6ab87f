"""The fused MoE's launch shapes on this GPU: every candidate `MoeLaunch` timed from a CUDA
graph (as a decode step replays it) per expert shape and token count, with random uniform
routing. Prints the fastest per token count and its bandwidth against the bytes the routed
experts really hold; writes everything to --out.

    python scripts/moe_sweep.py --out out/moe_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from kestrel.bench.limits import ExpertStack
from kestrel.layers.fused_moe import (
    MatvecLaunch,
    MoeLaunch,
    expected_repeats,
    expert_matvecs,
    fused_moe,
    moe_launch,
)

# name: (experts, top_k, hidden, expert intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-next": (512, 10, 2048, 512)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


MATVECS = [
    MatvecLaunch(n, k, warps)
    for n, k, warps in [(1, 1024, 4), (1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 8)]
]


DOWNS = [
    MatvecLaunch(n, k, warps)
    for n, k, warps in [(1, 256, 4), (2, 256, 4), (2, 512, 8), (4, 256, 8), (1, 1024, 4), (2, 1024, 8)]
]


def matvec_candidates() -> list:
    """For decode steps whose rows share no expert: (gate/up, down) matvec launch pairs. (Each
    routed row as its own 16-row tile of the grouped matmuls, what they replaced, measured
    slower on an H100: docs/benchmarks.md.)"""
    return list(itertools.product(MATVECS, DOWNS))


def candidates(tokens: int) -> list[MoeLaunch]:
    short = [
        MoeLaunch(16, n, k, 4, stages) for n, k, stages in itertools.product((32, 64, 128), (64, 128, 256), (2, 3, 4))
    ]
    tall = [
        MoeLaunch(m, n, k, warps, stages)
        for m, n, k, warps, stages in itertools.product((32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
    ] + [MoeLaunch(m, 256, 64, 8, 3) for m in (64, 128)]  # wide tiles for prefill-sized steps
    return (short if tokens <= 256 else []) + (tall if tokens >= 32 else [])


def graph_ms(run, repeats: int = 20) -> float:
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def sweep_shape(num_experts: int, top_k: int, hidden: int, inter: int, tokens_list, rows: list[dict], save) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=dtype) * 0.02
    stack = ExpertStack(num_experts, top_k, (w13[0].numel() + w2[0].numel()) * 2, 0)
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        logits = torch.randn(tokens, num_experts, device=device)
        weights, experts = logits.softmax(-1).topk(top_k, dim=-1)
        weights = weights.to(dtype)

        def step(launch, x=x, weights=weights, experts=experts) -> torch.Tensor:
            if isinstance(launch, tuple):
                return expert_matvecs(x, w13, w2, weights, experts.int(), launch)
            return fused_moe(x, w13, w2, weights, experts, launch)

        timings = []
        matvecs = expected_repeats(tokens * top_k, num_experts) < 1
        for launch in matvec_candidates() if matvecs else candidates(tokens):
            try:
                ms = graph_ms(lambda launch=launch: step(launch))
            except Exception as error:  # out of shared memory for this tile: not a candidate here
                print(f"  skip {launch}: {type(error).__name__}")
                continue
            timings.append((ms, launch))
        timings.sort(key=lambda pair: pair[0])
        best_ms, best = timings[0]
        table = moe_launch(tokens * top_k, num_experts)
        current_ms = graph_ms(lambda table=table: step(table))
        distinct = len(torch.unique(experts))
        gb_s = distinct * stack.bytes_per_expert / best_ms / 1e6
        rows.append(
            dict(
                tokens=tokens,
                num_rows=tokens * top_k,
                best_ms=best_ms,
                best=str(best),
                table_ms=current_ms,
                distinct_experts=distinct,
                expected_distinct=stack.expected_distinct(tokens),
                best_gb_s=gb_s,
                top5=[(ms, str(launch)) for ms, launch in timings[:5]],
            )
        )
        print(
            f"  tokens {tokens:5d}: best {best_ms * 1e3:8.1f} us {best} ({gb_s:.0f} GB/s of routed experts); "
            f"table's {current_ms * 1e3:8.1f} us",
            flush=True,
        )
        save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out/moe_sweep.json")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    report: dict[str, list[dict]] = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a call cut short still returns what it measured
        Path(args.out).write_text(json.dumps(report, indent=1))

    for name, shape in SHAPES.items():
        print(name, shape, flush=True)
        report[name] = []
        sweep_shape(*shape, args.tokens, report[name], save)


if __name__ == "__main__":
    main()
