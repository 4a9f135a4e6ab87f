"""Serving benchmark: streams completions from any OpenAI-compatible server and reports
throughput and TTFT / TPOT / ITL / end-to-end latency (mean, median, p99)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_requests(count: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    # Token ids well inside any vocabulary, away from the special tokens usually at either end.
    low, high = 100, max(101, vocab_size - 100)
    return [BenchRequest([rng.randrange(low, high) for _ in range(input_len)], output_len) for _ in range(count)]


def sharegpt_requests(path: Path, count: int, output_len: int, seed: int) -> list[BenchRequest]:
    conversations = json.loads(path.read_text())
    prompts = []
    for item in conversations:
        turns = item.get("conversations") or []
        if turns and turns[0].get("value"):
            prompts.append(turns[0]["value"])
    if not prompts:
        raise ValueError(f"{path} holds no ShareGPT conversations")
    rng = random.Random(seed)
    return [BenchRequest(rng.choice(prompts), output_len) for _ in range(count)]


async def send(client: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestRecord:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if record.ttft == 0.0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
        record.e2e = time.perf_counter() - start
        record.ok = True
    except httpx.HTTPError as error:
        record.error = repr(error)
    return record


async def run_load(
    base_url: str, model: str, requests: list[BenchRequest], rate: float, concurrency: int | None, api_key: str | None
) -> tuple[list[RequestRecord], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(requests))
    gate = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(0)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:

        async def one(request: BenchRequest) -> RequestRecord:
            async with gate:
                return await send(client, model, request)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean_ms": statistics.fmean(values) * 1e3,
        "median_ms": statistics.median(values) * 1e3,
        "p99_ms": p99 * 1e3,
    }


def report(records: list[RequestRecord], duration: float) -> dict:
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "ttft": summarize([r.ttft for r in done]),
        "tpot": summarize([r.tpot for r in done if r.tpot is not None]),
        "itl": summarize([gap for r in done for gap in r.itl]),
        "e2e": summarize([r.e2e for r in done]),
    }


def plot(records: list[RequestRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok]
    series = {
        "TTFT (ms)": [r.ttft * 1e3 for r in done],
        "TPOT (ms)": [r.tpot * 1e3 for r in done if r.tpot is not None],
        "ITL (ms)": [g * 1e3 for r in done for g in r.itl],
        "end-to-end (s)": [r.e2e for r in done],
    }
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for axis, (title, values) in zip(axes, series.items()):
        axis.hist(values, bins=40)
        axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def model_name(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def run_serve_benchmark(args: argparse.Namespace) -> int:
    base_url = args.base_url.rstrip("/")
    model = args.model or model_name(base_url, args.api_key)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        requests = sharegpt_requests(Path(args.dataset_path), args.num_prompts, args.output_len, args.seed)
    else:
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.seed)
    rate = float("inf") if args.request_rate == "inf" else float(args.request_rate)
    records, duration = asyncio.run(run_load(base_url, model, requests, rate, args.max_concurrency, args.api_key))
    result = report(records, duration) | {
        "model": model,
        "base_url": base_url,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
    }
    print(json.dumps(result, indent=2))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(records, Path(args.plot))
    return 0 if result["failed"] == 0 else 1


def add_serve_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="defaults to the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1000, help="random prompts draw ids below this")
    parser.add_argument("--request-rate", default="inf", help="requests per second, or inf")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG of the latency distributions")
