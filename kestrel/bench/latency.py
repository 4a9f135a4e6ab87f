"""Single-request latency: decode time per token next to the memory-bandwidth limit and to
HF transformers `generate`, all measured in the same run."""

from __future__ import annotations

import argparse
import json
import time

import torch

from kestrel.bench.limits import ModelCost
from kestrel.core.batch import KV_GROUP


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Bytes/s moved by a device-to-device copy (each byte is read once and written once)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    _sync(device)
    repeats = 10
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    _sync(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def speculative_runs(args, kwargs: dict, config, prompt: list[int]) -> dict:
    """The same request with speculative decoding: timed as it comes, and, with
    --simulate-acceptance, at chosen acceptance rates."""
    from kestrel import LLM
    from kestrel.bench.speculative import simulated_acceptance_sweep

    speculative = LLM(args.dummy_config or args.model, **kwargs, speculative_config=config)
    report = {"config": str(config), "as_is": time_kestrel(speculative, prompt, args.output_len)}
    if args.simulate_acceptance:
        report["simulated"] = simulated_acceptance_sweep(
            speculative, prompt, args.output_len, args.simulate_acceptance, forced=True
        )
        for row in report["simulated"][1:]:
            print(
                f"simulated (forced) acceptance {row['simulated_acceptance']:.0%} k={row['k']}: "
                f"{row['ms_per_output_token']:.2f} ms per token (prefill included), {row['speedup']:.2f}x "
                f"drafting nothing ({report['simulated'][0]['ms_per_output_token']:.2f} ms); "
                f"measured acceptance {row['measured_acceptance']:.0%}, same tokens {row['same_tokens']}"
            )
    release(speculative)
    return report


def release(llm) -> None:
    """Give the engine's device memory back (its weights, pools and graphs)."""
    import gc

    llm.shutdown()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_kestrel(llm, prompt: list[int], output_len: int) -> dict[str, float]:
    from kestrel import SamplingParams

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        llm.engine.parts.runtime.synchronize()
        return time.perf_counter() - start

    run(4)  # warm-up: kernel compilation, allocator
    first_token = min(run(1) for _ in range(3))
    total = run(output_len)
    return {
        "ttft_s": first_token,
        "total_s": total,
        "decode_ms_per_token": (total - first_token) / (output_len - 1) * 1e3,
    }


class _TokenClock:
    """HF generate's streamer interface used as a clock: when each new token reached the host.
    Its first `put` is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        value.to("cpu")  # waits for the token
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def time_hf(model, prompt: list[int], output_len: int) -> dict[str, float]:
    """First token and decode time from one generation, each token timed as it comes: the
    difference of two runs' times can come out negative on a noisy machine."""
    device = next(model.parameters()).device
    inputs = torch.tensor([prompt], device=device)

    def run(max_new: int) -> tuple[float, _TokenClock]:
        clock = _TokenClock()
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
                streamer=clock,
            )
        _sync(device)
        return start, clock

    run(2)
    start, clock = run(output_len)
    first_token, total = clock.times[0] - start, clock.times[-1] - start
    return {
        "ttft_s": first_token,
        "total_s": total,
        "decode_ms_per_token": (total - first_token) / (output_len - 1) * 1e3,
    }


def run_latency_benchmark(args: argparse.Namespace) -> int:
    from kestrel import LLM
    from kestrel.bench.throughput import build_hf_model, random_prompts
    from kestrel.engine.options import engine_kwargs

    kwargs = engine_kwargs(args)
    if args.dummy_config:
        kwargs["load_format"] = "dummy"
    speculative_config = kwargs.pop("speculative_config")
    if args.simulate_acceptance and speculative_config is None:
        raise SystemExit("--simulate-acceptance needs --speculative-config")
    llm = LLM(args.dummy_config or args.model, **kwargs)
    parts = llm.engine.parts
    spec, device = parts.spec, parts.runtime.device
    prompt = random_prompts(1, args.input_len, spec.vocab_size)[0]
    kestrel_times = time_kestrel(llm, prompt, args.output_len)
    cost = ModelCost.of(parts)
    mean_context = args.input_len + args.output_len / 2
    step_bytes = cost.decode_step_bytes(1, mean_context)
    bandwidth = copy_bandwidth(device)
    limit_ms = step_bytes / bandwidth * 1e3
    report = {
        "model": args.dummy_config or args.model,
        "dtype": str(parts.dtype),
        "device": str(device),
        "backend": parts.groups[KV_GROUP].binder.name,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "kestrel": kestrel_times,
        "model_weight_bytes": sum(p.numel() * p.element_size() for p in parts.runner.model.parameters()),
        "weight_bytes_per_step": cost.weight_bytes(1),
        "kv_bytes_per_step": mean_context * cost.kv_bytes_per_token,
        "recurrent_state_bytes_per_step": 2 * cost.recurrent_bytes_per_sequence,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_limit_ms_per_token": limit_ms,
        "kestrel_over_limit": kestrel_times["decode_ms_per_token"] / limit_ms,
    }
    dtype = parts.dtype
    del parts, cost
    # Each engine below is built after the last one is released: a large model and another
    # copy of it (speculating, or HF's) need not fit on the device together.
    release(llm)
    if speculative_config is not None:
        report["speculative"] = speculative_runs(args, kwargs, speculative_config, prompt)
    if args.hf_baseline:
        hf = build_hf_model(args, dtype, device)
        report["hf"] = time_hf(hf, prompt, args.hf_output_len)
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0
