"""Disaggregated against colocated serving under a mixed workload: chat requests (short prompts,
long answers) arriving at a steady rate, with long prompts (short answers) among them. Each
deployment gets the same requests at the same moments; the script reports, per kind of
request, TTFT and inter-token latency (median, p99) and the output token rate.

    colocated:     one instance
    disaggregated: a prefill instance + a decode instance behind `kestrel router`, the state
                   handed over through CUDA IPC (--kv-buffer-device cuda) or TCP (cpu)

On one GPU both of the disaggregated instances share it (each its own weights and pool).

    python scripts/pd_serving_bench.py --model llama-3-8b --load-format dummy --device cuda \\
        --chat-prompts 300 --chat-rate 6 --long-prompts 20 --long-input-len 6000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.bench.serve import BenchRequest, RequestRecord, send, summarize  # noqa: E402
from tests.server.conftest import API_KEY, RouterProcess, ServerProcess, stop_together  # noqa: E402


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    kind: str  # "chat" | "long"
    request: BenchRequest


def workload(args: argparse.Namespace, vocab_size: int) -> list[Arrival]:
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, vocab_size - 100) for _ in range(length)]

    arrivals, clock = [], 0.0
    for _ in range(args.chat_prompts):
        arrivals.append(Arrival(clock, "chat", BenchRequest(prompt(args.chat_input_len), args.chat_output_len)))
        clock += rng.expovariate(args.chat_rate)
    for index in range(args.long_prompts):  # spread evenly over the chat traffic
        at = clock * (index + 0.5) / args.long_prompts
        arrivals.append(Arrival(at, "long", BenchRequest(prompt(args.long_input_len), args.long_output_len)))
    return sorted(arrivals, key=lambda arrival: arrival.at)


async def replay(base_url: str, model: str, arrivals: list[Arrival]) -> tuple[list[tuple[str, RequestRecord]], float]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=len(arrivals))
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def one(arrival: Arrival) -> tuple[str, RequestRecord]:
            await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
            return arrival.kind, await send(client, model, arrival.request)

        records = await asyncio.gather(*(one(arrival) for arrival in arrivals))
        return list(records), time.perf_counter() - start


def summary(records: list[tuple[str, RequestRecord]], duration: float) -> dict:
    result: dict = {"duration_s": round(duration, 2)}
    for kind in ("chat", "long"):
        done = [r for k, r in records if k == kind and r.ok]
        failed = [r.error for k, r in records if k == kind and not r.ok]
        result[kind] = {
            "completed": len(done),
            "failed": len(failed),
            "errors": sorted(set(failed))[:3],
            "ttft": summarize([r.ttft for r in done]),
            "itl": summarize([gap for r in done for gap in r.itl]),
            "output_tok_s": round(sum(r.output_tokens for r in done) / duration, 1),
        }
    return result


def start(args: argparse.Namespace, *extra: str) -> ServerProcess:
    common = ["--load-format", args.load_format, "--device", args.device, "--max-model-len", str(args.max_model_len)]
    return ServerProcess(Path(args.model), *common, *args.server_arg, *extra, name_flag=False, wait=False)


def run_colocated(args: argparse.Namespace, arrivals: list[Arrival]) -> dict:
    server = start(args, "--kv-cache-memory-gb", str(args.kv_cache_memory_gb))
    try:
        server.wait_healthy(args.startup_timeout)
        records, duration = asyncio.run(replay(server.base_url, args.model, arrivals))
        return summary(records, duration)
    finally:
        server.stop()


def run_disaggregated(args: argparse.Namespace, arrivals: list[Arrival]) -> dict:
    prefill = start(
        args, "--kv-role", "prefill", "--kv-buffer-device", args.kv_buffer_device,
        "--kv-cache-memory-gb", str(args.prefill_kv_cache_memory_gb),
    )  # fmt: skip
    decode = start(args, "--kv-role", "decode", "--kv-cache-memory-gb", str(args.kv_cache_memory_gb))
    router = None
    try:
        prefill.wait_healthy(args.startup_timeout)
        decode.wait_healthy(args.startup_timeout)
        router = RouterProcess([prefill.base_url], [decode.base_url], timeout=600)
        records, duration = asyncio.run(replay(router.base_url, args.model, arrivals))
        result = summary(records, duration)
        result["state_fetched_bytes"] = decode.metric("kv_transfer_received_bytes_total")
        result["leftover_pages"] = prefill.metric("kv_cache_used_pages") + decode.metric("kv_cache_used_pages")
        return result
    finally:
        if router is not None:
            stop_together(router, prefill, decode)
        else:
            prefill.stop()
            decode.stop()


def vocab_size(args: argparse.Namespace) -> int:
    from kestrel.models.dummy_configs import DUMMY_CONFIGS

    if args.model in DUMMY_CONFIGS:
        return int(DUMMY_CONFIGS[args.model]["vocab_size"])
    return int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a checkpoint, or a built-in shape with --load-format dummy")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=8.0, help="colocated and decode instances")
    parser.add_argument("--prefill-kv-cache-memory-gb", type=float, default=4.0)
    parser.add_argument("--kv-buffer-device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--server-arg", action="append", default=[], help="passed to every instance")
    parser.add_argument("--chat-prompts", type=int, default=200)
    parser.add_argument("--chat-input-len", type=int, default=256)
    parser.add_argument("--chat-output-len", type=int, default=256)
    parser.add_argument("--chat-rate", type=float, default=4.0, help="chat requests per second (Poisson)")
    parser.add_argument("--long-prompts", type=int, default=16)
    parser.add_argument("--long-input-len", type=int, default=6000)
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--deployments", nargs="+", default=["colocated", "disaggregated"])
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    arrivals = workload(args, vocab_size(args))
    runners = {"colocated": run_colocated, "disaggregated": run_disaggregated}
    results = {}
    for name in args.deployments:
        results[name] = runners[name](args, arrivals)
        print(json.dumps({name: results[name]}, indent=2), flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2) + "\n")
    failed = sum(result[kind]["failed"] for result in results.values() for kind in ("chat", "long"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
