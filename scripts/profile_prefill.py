"""What a step with prefill costs on a GPU: engine steps that each take a fresh batch of
prompt chunks beside running decode rows, their wall time against the time their matmul
FLOPs take at the measured matmul rate, and the CUDA time of each kernel in them.

    python scripts/profile_prefill.py --kv-cache-dtype fp8 --out out/prefill.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kestrel import LLM, SamplingParams
from kestrel.bench.limits import ModelCost
from kestrel.bench.throughput import matmul_flops_per_s, random_prompts
from kestrel.bench.trace import device_timeline


def add_prompts(engine, prompts: list[list[int]], tag: str) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=100_000, ignore_eos=True, seed=0)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)


def prefilling(engine) -> int:
    return sum(1 for r in engine._requests.values() if r.num_computed_tokens < len(r.prompt_token_ids))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dummy-config", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--decode-rows", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="out/prefill.json")
    args = parser.parse_args()
    llm = LLM(
        args.dummy_config,
        load_format="dummy",
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        max_model_len=4096,
        max_num_seqs=256,
    )
    engine = llm.engine
    spec, runtime = engine.parts.spec, engine.parts.runtime
    budget = engine.parts.planner.config.max_num_batched_tokens
    per_step = budget // args.input_len
    prompts = random_prompts(args.decode_rows + per_step * (2 * args.steps + 1), args.input_len, spec.vocab_size)
    add_prompts(engine, prompts[: args.decode_rows], "decode")
    while prefilling(engine):  # the decode rows' prompts; compiles every kernel on the way
        engine.step()
    for _ in range(3):
        engine.step()
    fresh = prompts[args.decode_rows :]
    add_prompts(engine, fresh[:per_step], "warm")  # one step of the measured kind, unmeasured
    engine.step()

    def measured_steps(tag: str, first: int) -> float:
        """Steps that each prefill `per_step` prompts never seen before (none cached)."""
        runtime.synchronize()
        start = time.perf_counter()
        for step in range(args.steps):
            chunk = fresh[per_step * (first + step) : per_step * (first + step + 1)]
            add_prompts(engine, chunk, f"{tag}-{step}")
            engine.step()
        runtime.synchronize()
        return (time.perf_counter() - start) / args.steps

    wall_ms = measured_steps("timed", 1) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        measured_steps("profiled", 1 + args.steps)
    timeline = device_timeline(prof, Path(args.out).with_suffix(".trace.json"), args.steps)
    tokens = per_step * args.input_len + args.decode_rows
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rate = matmul_flops_per_s(budget, spec, dtype, torch.device(args.device))
    cost = ModelCost.of(llm.engine.parts)
    sampled = args.decode_rows + per_step  # only sampled positions reach the LM head
    matmul_ms = (cost.flops_per_token(0) * tokens + 2 * cost.lm_head_params * sampled) / rate * 1e3
    report = {
        "args": vars(args),
        "tokens_per_step": tokens,
        "step_ms": wall_ms,
        "matmul_rate_tflops": rate / 1e12,
        "matmul_flops_ms": matmul_ms,
        "device": timeline,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
