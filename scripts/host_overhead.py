"""The engine's host work per decode step, on a model too small for its forward to matter.

A one-layer model of hidden size 64 runs `--running` decoding requests while `--waiting`
more wait with long prompts (the shape of a saturated server); the mean step time is then
nearly all host work: planning, input preparation, sampling bookkeeping, detokenization.

    python scripts/host_overhead.py --running 256 --waiting 744 --prompt-len 1000
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from kestrel import LLM, SamplingParams
from kestrel.demo import make_demo_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=744)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tiny = make_demo_model(
            directory,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
        )
        llm = LLM(str(tiny), max_num_seqs=args.running, kv_cache_memory_gb=2)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=10_000, ignore_eos=True)
    for index in range(args.running + args.waiting):
        engine.add_request(str(index), [rng.randrange(500) for _ in range(args.prompt_len)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine._running) or not engine._running:
        engine.step()  # prefill the running requests
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(f"{args.running} running, {args.waiting} waiting, {args.prompt_len}-token prompts: {step_ms:.2f} ms per step")


if __name__ == "__main__":
    main()
