"""Start-up benchmark: the time from `LLM(model=...)` to the first generated token, each trial
in a fresh interpreter (so no import, file or allocator cache of an earlier trial helps)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

# One trial: import first (not counted), then time the engine's construction and one token.
TRIAL = """
import json, sys, time
from kestrel import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(sys.argv[1], device=sys.argv[2])
built = time.perf_counter()
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
done = time.perf_counter()
print(json.dumps({"construct_s": built - start, "first_token_s": done - start}))
"""


def add_startup_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a checkpoint directory, a .gguf file or a model id")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--trials", type=int, default=3)


def run_startup_benchmark(args: argparse.Namespace) -> int:
    trials = []
    for _ in range(args.trials):
        result = subprocess.run(
            [sys.executable, "-c", TRIAL, args.model, args.device], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            print(result.stderr, file=sys.stderr)
            return 1
        trials.append(json.loads(result.stdout.strip().splitlines()[-1]))
    firsts = [t["first_token_s"] for t in trials]
    summary = {
        "model": args.model,
        "trials": trials,
        "first_token_s_median": statistics.median(firsts),
        "first_token_s_max": max(firsts),
    }
    print(json.dumps(summary, indent=2))
    return 0
