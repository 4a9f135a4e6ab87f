"""Prefix caching benchmark: requests sharing long system prompts, in one run either caching
off against on, or (with `--kv-offloading-size`) caching without against with the host KV tier.

With `--num-systems` above 1, requests take the system prompts in turn; with a small
`--kv-cache-memory-gb` the device pool then cannot keep them all, which is the workload a
host tier is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def run_once(args: argparse.Namespace, prompts: list[list[int]], **options) -> tuple[dict, list[list[int]]]:
    from kestrel import LLM, SamplingParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_model_len=args.max_model_len,
        num_state_snapshots=getattr(args, "num_state_snapshots", None),
        seed=0,
        **options,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    first_token: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            first_token.setdefault(output.request_id, time.perf_counter() - start)
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
    total = time.perf_counter() - start
    stats = engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    ttfts = sorted(first_token.values())
    report = {
        **{name: value for name, value in options.items() if value is not None},
        "total_s": total,
        "s_per_request": total / len(prompts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_median_s": statistics.median(ttfts),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": prompt_tokens - stats.prefix_cache_hits,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "kv_offload_hit_tokens": stats.kv_offload_hit_tokens,
        "kv_offload_stored_bytes": stats.kv_offload_stored_bytes,
        "kv_offload_loaded_bytes": stats.kv_offload_loaded_bytes,
    }
    return report, [outputs[str(i)] for i in range(len(prompts))]


def workload(args: argparse.Namespace) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(100, 1000, (count,), generator=generator).tolist()

    systems = [tokens(args.system_len) for _ in range(args.num_systems)]
    return [systems[index % args.num_systems] + tokens(args.question_len) for index in range(args.num_prompts)]


def run_prefix_benchmark(args: argparse.Namespace) -> int:
    prompts = workload(args)
    if args.kv_offloading_size is None:
        (base, base_outputs), (new, new_outputs) = (
            run_once(args, prompts, enable_prefix_caching=False),
            run_once(args, prompts, enable_prefix_caching=True),
        )
        names = ("off", "on")
    else:
        (base, base_outputs), (new, new_outputs) = (
            run_once(args, prompts, enable_prefix_caching=True),
            run_once(args, prompts, enable_prefix_caching=True, kv_offloading_size=args.kv_offloading_size),
        )
        names = ("device_only", "host_tier")
    report = {
        names[0]: base,
        names[1]: new,
        "prefill_reduction": base["prefill_tokens_computed"] / max(new["prefill_tokens_computed"], 1),
        "speedup_per_request": base["s_per_request"] / new["s_per_request"],
        "identical_outputs": sum(a == b for a, b in zip(base_outputs, new_outputs)),
    }
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(report, handle, indent=2)
    if report["identical_outputs"] != len(prompts):
        print(f"outputs differ: {len(prompts) - report['identical_outputs']} of {len(prompts)} requests")
        return 1
    return 0


def add_prefix_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a checkpoint, or a built-in shape with --load-format dummy")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-systems", type=int, default=1, help="distinct system prompts, taken in turn")
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None, help="the device KV pool's size")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host KV tier: compare prefix caching without it against with it",
    )
    parser.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        help="hybrid models: copies of the recurrent state the prefix cache may keep (default: the engine's)",
    )
    parser.add_argument("--output-json", default=None)
