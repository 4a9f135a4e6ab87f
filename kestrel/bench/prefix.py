"""Prefix caching benchmark: requests sharing a long system prompt, caching on vs off in one run."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def run_once(model: str, load_format: str, enable: bool, prompts: list[list[int]], output_len: int) -> dict:
    from kestrel import LLM, SamplingParams

    llm = LLM(model, load_format=load_format, enable_prefix_caching=enable, seed=0)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    first_token: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            first_token.setdefault(output.request_id, time.perf_counter() - start)
    total = time.perf_counter() - start
    stats = engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    ttfts = sorted(first_token.values())
    return {
        "prefix_caching": enable,
        "total_s": total,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_median_s": statistics.median(ttfts),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": prompt_tokens - stats.prefix_cache_hits,
        "prefix_cache_hits": stats.prefix_cache_hits,
    }


def run_prefix_benchmark(args: argparse.Namespace) -> int:
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(100, 1000, (args.system_len,), generator=generator).tolist()
    prompts = [
        system + torch.randint(100, 1000, (args.question_len,), generator=generator).tolist()
        for _ in range(args.num_prompts)
    ]
    off = run_once(args.model, args.load_format, False, prompts, args.output_len)
    on = run_once(args.model, args.load_format, True, prompts, args.output_len)
    report = {"off": off, "on": on, "prefill_reduction": off["prefill_tokens_computed"] / on["prefill_tokens_computed"]}
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


def add_prefix_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a checkpoint, or a built-in shape with --load-format dummy")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--output-json", default=None)
