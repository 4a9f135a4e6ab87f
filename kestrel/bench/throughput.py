"""Offline throughput: Kestrel and Hugging Face `generate` on the same workload, in one run,
next to the compute limit set by this machine's measured matmul rate."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from kestrel.bench.latency import copy_bandwidth
from kestrel.bench.limits import ModelCost, compute_limit_tokens_per_s, memory_limit_tokens_per_s
from kestrel.layers.quantized import COMPUTE_DTYPE
from kestrel.models.spec import DecoderSpec


@dataclass(frozen=True)
class Measurement:
    name: str
    concurrency: int
    num_requests: int
    output_tokens: int
    seconds: float
    preemptions: int = 0  # requests preempted for KV pages during the run (Kestrel's)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def time_kestrel(llm, prompts: list[list[int]], output_len: int) -> Measurement:
    from kestrel import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    preempted_before = llm.engine.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    llm.engine.parts.runtime.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    preempted = llm.engine.num_preemptions - preempted_before
    return Measurement("kestrel", len(prompts), len(prompts), tokens, seconds, preempted)


def time_hf(model, prompts: list[list[int]], output_len: int) -> Measurement:
    """All prompts as one batch (they share a length, so nothing is padded)."""
    device = next(model.parameters()).device
    inputs = torch.tensor(prompts, device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=True,
            temperature=1.0,
            top_k=0,  # the same plain sampling Kestrel runs (HF defaults to top_k=50)
            top_p=1.0,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - inputs.shape[1]) * out.shape[0]
    return Measurement("hf-transformers", len(prompts), len(prompts), tokens, seconds)


def matmul_flops_per_s(tokens: int, spec: DecoderSpec, dtype: torch.dtype, device: torch.device) -> float:
    """The rate of the model's largest matmul at this batch shape, measured here."""
    a = torch.randn(tokens, spec.hidden_size, dtype=dtype, device=device)
    b = torch.randn(spec.hidden_size, spec.intermediate_size, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    repeats = 20
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * tokens * spec.hidden_size * spec.intermediate_size / seconds


def build_hf_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    if args.dummy_config:
        from kestrel.models.dummy_configs import dummy_hf_config

        with torch.device(device):  # initialise the random weights where they will live
            return AutoModelForCausalLM.from_config(dummy_hf_config(args.dummy_config), dtype=dtype).eval()
    if args.load_format == "dummy":  # a config folder without weights: random ones, as Kestrel's
        from transformers import AutoConfig

        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=dtype).eval()
    if args.model.endswith(".gguf"):  # transformers dequantizes a GGUF file itself
        from pathlib import Path

        path = Path(args.model)
        return (
            AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()
        )
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()


def run_throughput_benchmark(args: argparse.Namespace) -> int:
    from kestrel import LLM
    from kestrel.engine.options import engine_kwargs

    kwargs = engine_kwargs(args)
    if args.dummy_config:
        kwargs["load_format"] = "dummy"
    llm = LLM(args.dummy_config or args.model, **kwargs)
    spec, dtype, device = llm.engine.parts.spec, llm.engine.parts.dtype, llm.engine.parts.runtime.device
    prompts = random_prompts(args.num_prompts, args.input_len, spec.vocab_size)
    time_kestrel(llm, prompts[:2], 4)  # warm-up
    results = [time_kestrel(llm, prompts[:1], args.output_len), time_kestrel(llm, prompts, args.output_len)]
    if args.hf_baseline:
        hf = build_hf_model(args, dtype, device)
        time_hf(hf, prompts[:2], 4)
        results += [time_hf(hf, prompts[:1], args.output_len), time_hf(hf, prompts, args.output_len)]
    # The fastest rate any of its matmuls may run at: 4-bit weights compute in bfloat16.
    compute_dtypes = {dtype} | ({COMPUTE_DTYPE} if llm.engine.parts.quantization else set())
    rate = max(matmul_flops_per_s(args.num_prompts, spec, d, device) for d in compute_dtypes)
    cost = ModelCost.of(llm.engine.parts)
    limit = compute_limit_tokens_per_s(cost, args.num_prompts, args.input_len, args.output_len, rate)
    bandwidth = copy_bandwidth(device, 1 << 28)
    memory_limit = memory_limit_tokens_per_s(
        cost, args.num_prompts, args.input_len, args.output_len, args.max_num_seqs, bandwidth
    )
    quantized = f", {llm.engine.parts.quantization} weights" if llm.engine.parts.quantization else ""
    print(f"model {spec.architecture}, {cost.num_params / 1e6:.1f}M parameters, {dtype}{quantized}, {device}")
    print(f"workload: input {args.input_len}, output {args.output_len} tokens per request")
    print(f"{'engine':<18}{'concurrency':>12}{'requests/s':>12}{'output tok/s':>14}{'preempted':>11}")
    for m in results:
        print(
            f"{m.name:<18}{m.concurrency:>12}{m.requests_per_s:>12.2f}{m.output_tokens_per_s:>14.1f}{m.preemptions:>11}"
        )
    print(
        f"matmul rate at {args.num_prompts} rows: {rate / 1e9:.1f} GFLOP/s; "
        f"compute limit at concurrency {args.num_prompts}: {limit:.1f} output tok/s"
    )
    print(
        f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s; memory limit (the weights a step of "
        f"{min(args.num_prompts, args.max_num_seqs)} reads, KV and state per token): {memory_limit:.1f} output tok/s"
    )
    if args.output_json:
        report = {
            "results": [asdict(m) | {"output_tokens_per_s": m.output_tokens_per_s} for m in results],
            "matmul_flops_per_s": rate,
            "compute_limit_output_tokens_per_s": limit,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "memory_limit_output_tokens_per_s": memory_limit,
            "args": vars(args),
        }
        with open(args.output_json, "w") as handle:
            json.dump(report, handle, indent=2, default=str)
    return 0
