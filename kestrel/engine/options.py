"""The engine's command-line options, shared by `kestrel serve`, `generate` and the benchmarks."""

from __future__ import annotations

import argparse
from typing import Any

from kestrel.config import KV_CACHE_DTYPES, SSM_CACHE_DTYPES
from kestrel.engine.reasoning import REASONING_PARSERS


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="auto: the model's dtype; fp8 (fp8_e4m3): float8 e4m3 keys and values, half the bytes of bf16",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=list(SSM_CACHE_DTYPES),
        help="linear-attention layers' recurrent state: auto/float32 as transformers keeps it; bfloat16 or "
        "float16 halve the state each decode step reads and writes (vLLM's auto is the model's dtype)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory or id; default: the model's own")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face model id")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan the next step while the device runs this one",
    )
    parser.add_argument(
        "--dependent-launch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on Hopper and later GPUs, start each kernel while the one before it finishes",
    )
    parser.add_argument(
        "--preemption-mode",
        default="recompute",
        choices=["recompute", "swap"],
        help="a preempted request's state is recomputed later, or swapped to host memory and back",
    )
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory behind the prefix cache: evicted KV pages are kept there and copied back on a hit",
    )
    parser.add_argument("--kv-offloading-backend", default=None, choices=["native"])
    parser.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=512,
        help="hybrid models: keep the recurrent state for the prefix cache every this many tokens",
    )
    parser.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        help="hybrid models: copies of the recurrent state the prefix cache may keep (default: max-num-seqs)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="a thinking model's reasoning markers: the server splits reasoning_content out, and "
        "structured outputs apply after the reasoning",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 2}',
    )
    parser.add_argument(
        "--compilation-config",
        "-O",
        default=None,
        help='CPU: decode steps compiled whole (torch.compile), as JSON {"mode": 3, "compile_sizes": [1]} or a '
        "bare mode (-O3); compiling takes tens of seconds at start-up. Default: eager",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"])
    # vLLM's flags: the same names as the offline API's vLLM arguments (engine/compat.py).
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's name for --page-size")
    parser.add_argument("--trust-remote-code", action="store_true", help="accepted; Kestrel runs no checkpoint code")
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="int4: the decoder's weights packed to 4-bit groups of 32 after loading (CPU; a GGUF stored "
        "in Q4_1 keeps its own codes); fp8: float8 e4m3 weights with a scale per output row, activations "
        "quantized per token (float8 matmuls on CUDA); default: the weights as loaded",
    )
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--swap-space", type=float, default=None, help="accepted; preemption recomputes")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from kestrel.engine.compat import resolve_vllm_arguments

    vllm_flags = {
        name: value
        for name in ("trust_remote_code", "enable_chunked_prefill", "swap_space")
        if (value := getattr(args, name)) not in (None, False)
    }
    return resolve_vllm_arguments(vllm_flags) | dict(
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        page_size=args.block_size or args.page_size,
        seed=args.seed,
        load_format=args.load_format,
        tokenizer=args.tokenizer,
        revision=args.revision,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        dependent_launch=args.dependent_launch,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        state_snapshot_interval=args.state_snapshot_interval,
        num_state_snapshots=args.num_state_snapshots,
        reasoning_parser=args.reasoning_parser,
        speculative_config=args.speculative_config,
        compilation_config=args.compilation_config,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )
