"""Where an offline throughput run spends its time, step by step.

Runs the throughput workload (random prompts, `ignore_eos`, temperature 1.0) through the
engine, timing each step's phases: planning, resolving work, the runner's input
preparation, the forward (synchronised, so its time is the GPU's), sampling and absorbing
results. Steps are grouped by kind (decode-only, or with prefill tokens) and summed.

    python scripts/step_timeline.py --dummy-config llama-3-8b --device cuda --dtype bfloat16 \
        --num-prompts 512 --input-len 1000 --output-len 1000 --out out/timeline.json

Phase timing synchronises the device after the forward, which the engine does anyway when
it reads the sampled tokens, so the total matches an untimed run closely.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from kestrel import LLM, SamplingParams
from kestrel.bench.throughput import random_prompts
from kestrel.core.planner import Capacity
from kestrel.sampling_params import RequestOutputKind


class PhaseClock:
    def __init__(self, synchronize) -> None:
        self.synchronize = synchronize
        self.phases: dict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    def lap(self, phase: str, sync: bool = False) -> None:
        if sync:
            self.synchronize()
        now = time.perf_counter()
        self.phases[phase] += now - self._last
        self._last = now


def timed_step(engine, clock: PhaseClock):
    parts = engine.parts
    runner = parts.runner
    plan = parts.planner.plan(engine._queue_state(), Capacity(parts.kv.free_capacity(), parts.kv.spec.page_size))
    engine._apply(plan)
    clock.lap("plan")
    work = [engine._work_for(chunk) for chunk in plan.scheduled]
    clock.lap("work")
    if not work:
        return plan, []
    ordered = sorted(work, key=lambda item: not item.is_decode)
    layout = runner._layout(ordered)
    token_ids, positions, logits_indices, rows = runner._host_inputs(ordered)
    clock.lap("prepare")
    if runner._fits_graph(ordered):
        logits = runner.graphs.run(layout, token_ids, positions)
        clock.lap("forward_graph", sync=True)
    else:
        logits = runner._run_eager(layout, ordered, token_ids, positions, logits_indices)
        clock.lap("forward_eager", sync=True)
    sampled = runner._sample(ordered, rows, logits)
    prompt = runner._prompt_logprobs(ordered, rows, logits)
    clock.lap("sample")
    from kestrel.core.runner import SequenceResult

    results = tuple(
        SequenceResult(item.request_id, sampled.get(item.request_id), prompt.get(item.request_id, ()))
        for item in ordered
    )
    outputs = engine._absorb(plan.scheduled, results)
    clock.lap("absorb")
    return plan, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dummy-config", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--out", default="timeline.json")
    args = parser.parse_args()
    llm = LLM(
        args.model or args.dummy_config,
        load_format="dummy" if args.dummy_config else "auto",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
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
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        clock = PhaseClock(engine.parts.runtime.synchronize)
        step_start = time.perf_counter()
        plan, _ = timed_step(engine, clock)
        prefill_tokens = sum(c.num_new_tokens for c in plan.scheduled if c.num_new_tokens > 1)
        kind = "decode_only" if prefill_tokens == 0 else "with_prefill"
        totals = kinds[kind]
        totals["steps"] += 1
        totals["seconds"] += time.perf_counter() - step_start
        totals["prefill_tokens"] += prefill_tokens
        totals["decode_rows"] += sum(1 for c in plan.scheduled if c.num_new_tokens == 1)
        for phase, seconds in clock.phases.items():
            totals[phase] += seconds
    total = time.perf_counter() - start
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
