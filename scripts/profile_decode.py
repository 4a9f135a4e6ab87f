"""Where a decode step's time goes on a GPU: graph replay alone against a whole engine step,
per-kernel CUDA time at one sequence and at a full batch of long contexts, each linear's
bandwidth at one row, and the host functions of an engine step.

    python scripts/profile_decode.py --out out
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kestrel import LLM, SamplingParams
from kestrel.bench.trace import device_timeline
from kestrel.core.batch import KV_GROUP, BatchLayout, SequenceChunk
from kestrel.core.graph import GraphKey, GraphPhase


def replay_ms(graphs, size: int, repeats: int = 50) -> float:
    replay = graphs._graphs[GraphKey(GraphPhase.DECODE, size)]
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def kernel_table(graphs, size: int, path: Path) -> None:
    """Eager forward of the graphs' body (same kernels), per-kernel CUDA time."""
    with torch.inference_mode():
        graphs._forward(size)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graphs._forward(size)
            torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def replay_timeline(graphs, size: int, path: Path) -> dict[str, float]:
    """Kernels of one graph replay as the device ran them (dependent launches included): the
    Chrome trace beside `path`, its summary (kestrel/bench/trace.py) in it; the span and
    busy time are returned."""
    replay = graphs._graphs[GraphKey(GraphPhase.DECODE, size)]
    replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    summary = device_timeline(prof, path.with_suffix(".trace.json"))
    path.write_text(json.dumps(summary, indent=1))
    return {k: v for k, v in summary.items() if k in ("device_events", "span_ms_per_step", "busy_ms_per_step")}


def linear_bandwidth(device: torch.device) -> dict[str, float]:
    shapes = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }
    results = {}
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
        x = torch.randn(1, in_features, device=device, dtype=torch.bfloat16)
        for _ in range(5):
            F.linear(x, weight)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            F.linear(x, weight)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 100
        results[name] = weight.numel() * 2 / seconds / 1e9
    return results


def full_batch_steps(llm: LLM, out: Path, batch: int = 256, steps: int = 20) -> dict[str, object]:
    """Engine decode steps of a full batch (wall time, host profile) against their graph replay."""
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"batch-{index}", list(range(100 + index, 228 + index)), params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine._requests.values()):
        engine.step()
    engine.step()
    llm.engine.parts.runtime.synchronize()
    start = time.perf_counter()
    step_ends = []  # each step's own wall time: a few slow steps and many slower ones differ
    for _ in range(steps):
        engine.step()
        step_ends.append(time.perf_counter())
    wall_ms = (step_ends[-1] - start) / steps * 1e3
    step_ms = [round((end - begin) * 1e3, 2) for begin, end in zip([start, *step_ends], step_ends)]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (out / f"host_profile_batch{batch}.txt").write_text(text.getvalue())
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(5):
            engine.step()
        llm.engine.parts.runtime.synchronize()
    # Where an engine step's device time goes beyond its graph's, and the host calls in its gaps.
    timeline = device_timeline(prof, out / f"engine_timeline_batch{batch}.trace.json", steps=5)
    (out / f"engine_timeline_batch{batch}.json").write_text(json.dumps(timeline, indent=1))
    replay = replay_ms(engine.parts.runner.graphs, batch, steps)
    for index in range(batch):
        engine.abort_request(f"batch-{index}")
    report = {f"engine_step_ms_{batch}": wall_ms, f"engine_steps_ms_{batch}": step_ms}
    return report | {f"replay_ms_{batch}_ctx150": replay}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--context", type=int, default=1500, help="0 leaves out the long-context batch")
    parser.add_argument("--dummy-config", default="llama-3-8b")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=60)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the full batch profiled")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="fp8: float8 weights quantized at load")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(
        args.dummy_config,
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        quantization=args.quantization,
    )
    parts = llm.engine.parts
    graphs = parts.runner.graphs
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt, greedy, use_tqdm=False)
    report: dict[str, object] = {}

    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=257, ignore_eos=True), use_tqdm=False)
    report["engine_decode_ms"] = (time.perf_counter() - start - first) / 256 * 1e3
    report["replay_ms_1"] = replay_ms(graphs, 1)

    engine = llm.engine
    engine.add_request(
        "profiled", prompt["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    for _ in range(5):
        engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(100):
        engine.step()
    profiler.disable()
    engine.abort_request("profiled")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (out / "host_profile.txt").write_text(text.getvalue())
    kernel_table(graphs, 1, out / "kernels_batch1.txt")
    report["replay_timeline_1"] = replay_timeline(graphs, 1, out / "timeline_batch1.json")
    report.update(full_batch_steps(llm, out, batch=args.max_num_seqs))

    if args.context:
        report.update(long_context_batch(graphs, parts, args.context, out))
    if args.dummy_config == "llama-3-8b":  # the shapes linear_bandwidth times are Llama-3-8B's
        report["linear_gb_s_at_1_row"] = linear_bandwidth(torch.device("cuda"))
    print(json.dumps(report, indent=2))
    (out / "profile.json").write_text(json.dumps(report, indent=2))


def other_state_ids(parts, index: int, page_ids: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """A sequence's ids in the state groups besides the KV pages: a recurrent slot of its own
    (hybrid models), else the same pages."""
    ids = {}
    for name, group in parts.groups.items():
        if name == KV_GROUP:
            continue
        slots = group.provider.total_capacity()
        ids[name] = (index % slots,) if group.provider is parts.recurrent else page_ids
    return ids


def long_context_batch(graphs, parts, context: int, out: Path) -> dict[str, float]:
    """A full batch of long contexts: page tables pointing at real (garbage) pages."""
    report = {}
    page_size = parts.kv.spec.page_size
    pages_per_seq = -(-context // page_size)
    size = graphs.buckets[-1]
    table = torch.arange(size * pages_per_seq).view(size, pages_per_seq) % (parts.kv.total_capacity() - 1)
    chunks = tuple(
        SequenceChunk(1, context - 1, tuple(row.tolist()), other_state_ids(parts, index, tuple(row.tolist())))
        for index, row in enumerate(table)
    )
    layout = BatchLayout(chunks, len(chunks), page_size)
    for group in graphs.groups.values():
        group.binder.prepare_replay(layout, size)
    graphs.positions[:size] = context - 1
    report[f"replay_ms_{size}_ctx{context}"] = replay_ms(graphs, size, 20)
    kernel_table(graphs, size, out / f"kernels_batch{size}.txt")
    report[f"replay_timeline_{size}"] = replay_timeline(graphs, size, out / f"timeline_batch{size}.json")
    short = BatchLayout(
        tuple(SequenceChunk(1, 0, (chunk.page_ids[0],), chunk.state_ids) for chunk in chunks), len(chunks), page_size
    )
    for group in graphs.groups.values():
        group.binder.prepare_replay(short, size)
    report[f"replay_ms_{size}_ctx1"] = replay_ms(graphs, size, 20)
    return report


if __name__ == "__main__":
    main()
