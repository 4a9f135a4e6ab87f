"""Disaggregated serving on one machine: a prefill instance, a decode instance and the router,
against one instance alone, on the same prompts (greedy). Prints the time to fetch each
prompt's state, its bytes, and both deployments' request times; fails on any differing answer.

    python scripts/pd_transfer_bench.py --model MODEL --prompt-len 1000 --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.conftest import RouterProcess, ServerProcess  # noqa: E402


def metric_sum(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"kestrel:{name}{{"))


def answers(base_url: str, headers: dict, prompts: list[list[int]], output_len: int) -> tuple[list[str], float]:
    texts, start = [], time.perf_counter()
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=600)
        response.raise_for_status()
        texts.append(response.json()["choices"][0]["text"])
    return texts, (time.perf_counter() - start) / len(prompts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    common = ("--served-model-name", "m", "--max-model-len", "2048")
    single = ServerProcess(Path(args.model), *common, name_flag=False)
    prefill = ServerProcess(Path(args.model), *common, "--kv-role", "prefill", name_flag=False)
    decode = ServerProcess(Path(args.model), *common, "--kv-role", "decode", name_flag=False)
    router = RouterProcess([prefill.base_url], [decode.base_url])
    try:
        prompts = [
            [100 + (i * 7919 + j * 104729) % 20000 for j in range(args.prompt_len)] for i in range(args.num_prompts)
        ]
        headers = single.headers
        expected, single_s = answers(single.base_url, headers, prompts, args.output_len)
        got, pd_s = answers(router.base_url, headers, prompts, args.output_len)
        seconds = metric_sum(decode, "kv_transfer_seconds_sum")
        count = metric_sum(decode, "kv_transfer_seconds_count")
        received = metric_sum(decode, "kv_transfer_received_bytes_total")
        report = {
            "prompt_len": args.prompt_len,
            "fetches": count,
            "fetch_ms_mean": 1e3 * seconds / count,
            "fetch_ms_per_1000_tokens": 1e3 * seconds / count * 1000 / (args.prompt_len - 1),
            "bytes_per_fetch": received / count,
            "request_s_single": single_s,
            "request_s_disaggregated": pd_s,
            "identical": sum(a == b for a, b in zip(expected, got)),
        }
        print(json.dumps(report, indent=2))
        return 0 if report["identical"] == len(prompts) else 1
    finally:
        router.stop()
        for server in (single, prefill, decode):
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
