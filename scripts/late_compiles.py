"""Triton kernels compiled after start-up: every compile the warm-up should have done, but a
real workload triggered instead (a stall of about a second each, in the middle of serving).

Starts an engine, then runs the throughput workload (random prompts, chunked prefill beside
decoding rows) with a hook on Triton's compiler; prints each late compile's kernel and
argument specialisation.

    python scripts/late_compiles.py --dummy-config qwen3-30b-a3b --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import time

from kestrel import LLM, SamplingParams
from kestrel.bench.compiles import recorded_compiles
from kestrel.bench.throughput import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dummy-config", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(
        args.dummy_config,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
    )
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.parts.spec.vocab_size)
    start = time.perf_counter()
    with recorded_compiles() as late:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(f"{len(late)} kernels compiled after start-up, in a run of {seconds:.1f} s")
    for entry in late:
        print(f"  {entry[:1500]}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(late, file, indent=1)


if __name__ == "__main__":
    main()
