"""Where an offline throughput run spends its time, step by step.

Runs the throughput workload (random prompts, `ignore_eos`, temperature 1.0) through the
engine and times every step, and within it the time the host spends blocked on the device
(reading a step's samples). What is left is host work the device may have to wait for:
with overlapped scheduling it runs while the device computes the step launched before.
Steps are grouped by kind (decode-only, or with prefill tokens) and summed.

    python scripts/step_timeline.py --dummy-config llama-3-8b --device cuda --dtype bfloat16 \
        --num-prompts 512 --input-len 1000 --output-len 1000 --out out/timeline.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch

from kestrel import LLM, SamplingParams
from kestrel.bench.throughput import random_prompts
from kestrel.bench.trace import device_timeline
from kestrel.sampling_params import RequestOutputKind


class BlockedClock:
    """Wraps the executor so the time spent waiting in a step's `result()` is summed; with
    `sync_debug`, CUDA warns (with the line) of any synchronisation while a step launches."""

    def __init__(self, executor, sync_debug: bool = False) -> None:
        self.blocked = 0.0
        launch = executor.launch

        def checked_launch(work, *rest):
            if not sync_debug:
                return launch(work, *rest)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(work, *rest)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def timed_launch(work, *rest):
            pending = checked_launch(work, *rest)
            result = pending.result

            def timed_result():
                start = time.perf_counter()
                output = result()
                self.blocked += time.perf_counter() - start
                return output

            pending.result = timed_result
            return pending

        executor.launch = timed_launch


def trace_steps(engine, steps: int, path: Path) -> None:
    """The device's timeline over `steps` engine steps, summarised beside the trace."""
    engine.parts.runtime.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        engine.parts.runtime.synchronize()
    summary = device_timeline(prof, path, steps)
    path.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "longest_gaps"}, indent=1))
    for gap in summary.get("longest_gaps", [])[:5]:
        print(f"idle {gap['us']:.0f} us at {gap['at_us']:.0f} us: {gap['host']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dummy-config", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--out", default="timeline.json")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--sync-debug", action="store_true", help="CUDA: warn of syncs while steps launch")
    parser.add_argument("--profile", default=None, help="write the run's host profile (cProfile, by own time) here")
    parser.add_argument("--trace-from", type=int, default=None, help="trace the device from this step, then stop")
    parser.add_argument("--trace-steps", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(
        args.model or args.dummy_config,
        load_format="dummy" if args.dummy_config else "auto",
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        async_scheduling=args.async_scheduling,
    )
    engine = llm.engine
    spec = engine.parts.spec
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=0,
        output_kind=RequestOutputKind.FINAL_ONLY,  # as `LLM.generate` and `bench throughput`
    )
    for index, prompt in enumerate(random_prompts(args.num_prompts, args.input_len, spec.vocab_size)):
        engine.add_request(str(index), prompt, params)
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    clock = BlockedClock(engine.parts.executor, args.sync_debug)
    planner = engine.parts.planner
    plan_of_step = []
    original_plan = planner.plan

    def recording_plan(queue, capacity):
        plan = original_plan(queue, capacity)
        plan_of_step.append(plan)
        return plan

    planner.plan = recording_plan
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    step_index = 0
    while engine.has_unfinished_requests():
        if step_index == args.trace_from:
            trace_steps(engine, args.trace_steps, Path(args.out).with_suffix(".trace.json"))
            return  # a partial run: no throughput to report
        step_index += 1
        plan_of_step.clear()
        blocked_before, step_start = clock.blocked, time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - step_start
        scheduled = [c for plan in plan_of_step for c in plan.scheduled]
        prefill_tokens = sum(c.num_new_tokens for c in scheduled if c.num_new_tokens > 1)
        totals = kinds["decode_only" if prefill_tokens == 0 else "with_prefill"]
        totals["steps"] += 1
        totals["seconds"] += seconds
        totals["blocked_on_device"] += clock.blocked - blocked_before
        totals["host"] += seconds - (clock.blocked - blocked_before)
        totals["prefill_tokens"] += prefill_tokens
        totals["decode_rows"] += sum(1 for c in scheduled if c.num_new_tokens == 1)
    total = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
        Path(args.profile).write_text(text.getvalue())
    report = {
        "args": vars(args),
        "total_seconds": total,
        "output_tokens_per_s": args.num_prompts * args.output_len / total,
        "kinds": {kind: dict(values) for kind, values in kinds.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"total {total:.1f} s, {report['output_tokens_per_s']:.0f} output tok/s")
    for kind, values in report["kinds"].items():
        steps = values["steps"]
        counts = ("prefill_tokens", "decode_rows")
        per_step = {k: round(v / steps * (1 if k in counts else 1e3), 2) for k, v in values.items() if k != "steps"}
        print(f"{kind}: {steps:.0f} steps, per step (ms; tokens and rows as counts): {per_step}")


if __name__ == "__main__":
    main()
