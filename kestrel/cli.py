"""The `kestrel` command: its subcommands (the engine options they share are in
`kestrel.engine.options`)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from kestrel.engine.options import add_engine_options, engine_kwargs

# Benchmarks in a module of their own, kestrel/bench/NAME.py, which holds
# add_NAME_bench_options(parser) and run_NAME_benchmark(args).
OWN_MODULE_BENCHES = {
    "prefix": "shared system prompts: prefix caching on vs off, or without vs with the host KV tier",
    "startup": "time from LLM(model=...) to the first token, fresh processes",
    "structured": "every request JSON-schema constrained vs none",
    "speculative": "batch-1 copy tasks decoded plainly vs speculatively",
    "serve": "load an OpenAI-compatible server and measure latencies",
}


def run_generate(args: argparse.Namespace) -> int:
    from kestrel import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        completion = output.outputs[0]
        print(f"prompt: {output.prompt!r}")
        print(f"output: {completion.text!r}  ({len(completion.token_ids)} tokens, {completion.finish_reason})")
    return 0


def run_make_demo_model(args: argparse.Namespace) -> int:
    from kestrel.demo import make_demo_model

    path = make_demo_model(args.output_dir, seed=args.seed)
    print(f"wrote a demo Qwen3 checkpoint to {path}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from kestrel.config import EngineArgs
    from kestrel.sampling_params import MAX_LOGPROBS
    from kestrel.server.engine_client import EngineDeadError
    from kestrel.server.serve import EngineCoreDied, serve

    if args.model and args.model_option and args.model != args.model_option:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}")
    args.model = args.model or args.model_option
    if not args.model:
        raise ValueError("serve needs a model: kestrel serve MODEL (or --model MODEL)")
    if args.max_logprobs > MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs {args.max_logprobs} is above {MAX_LOGPROBS}, the most Kestrel returns")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of the formats the model writes)")
    if args.kv_role is not None and args.tensor_parallel_size > 1:
        raise ValueError("--kv-role hands over rank 0's state only; it does not run with tensor parallelism yet")
    if args.tokenizer is None and is_builtin_shape(args.model, args.load_format):
        args.tokenizer = str(numbered_tokenizer(args.model))
    if args.kv_buffer_device != "cpu" and args.kv_role != "prefill":
        raise ValueError("--kv-buffer-device says where a prefill instance keeps its state; it needs --kv-role prefill")
    engine_args = EngineArgs(model=args.model, **engine_kwargs(args), kv_buffer_device=args.kv_buffer_device)
    try:
        asyncio.run(serve(args, engine_args))
    except EngineDeadError as error:  # the core could not start: say why, without a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    except EngineCoreDied as error:  # it died while serving: exit non-zero for a supervisor
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def is_builtin_shape(model: str, load_format: str) -> bool:
    from kestrel.models.dummy_configs import DUMMY_CONFIGS

    return load_format == "dummy" and model in DUMMY_CONFIGS and not Path(model).exists()


def numbered_tokenizer(name: str) -> Path:
    """A built-in shape has no tokenizer; a server needs one: `<id>` per token, in a folder of
    its own (removed at exit) that the engine core loads too."""
    import atexit
    import shutil
    import tempfile

    from kestrel.models.dummy_configs import write_numbered_tokenizer

    directory = Path(tempfile.mkdtemp(prefix=f"kestrel-tokenizer-{name}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return write_numbered_tokenizer(name, directory)


def run_router(args: argparse.Namespace) -> int:
    from kestrel.server.router import run_router as serve_router

    return serve_router(args)


def run_latency(args: argparse.Namespace) -> int:
    from kestrel.bench.latency import run_latency_benchmark

    return run_latency_benchmark(args)


def run_bench(args: argparse.Namespace) -> int:
    from kestrel.bench.throughput import run_throughput_benchmark

    return run_throughput_benchmark(args)


def add_offline_bench_options(parser: argparse.ArgumentParser, output_len: int) -> None:
    """What the in-process benchmarks share: the model (a checkpoint or a named dummy shape),
    the workload lengths, the HF baseline switch, a JSON report, and the engine's options."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model")
    source.add_argument("--dummy-config")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--hf-baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--output-json", default=None)
    add_engine_options(parser)


def add_commands(commands: Any) -> None:
    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("--model", required=True)
    generate.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--sampling-seed", type=int, default=None)
    add_engine_options(generate)
    generate.set_defaults(handler=run_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    from kestrel.server.options import add_serve_options

    add_serve_options(serve)
    add_engine_options(serve)
    serve.set_defaults(handler=run_serve)

    router = commands.add_parser("router", help="one OpenAI endpoint in front of prefill and decode instances")
    from kestrel.server.options import add_router_options

    add_router_options(router)
    router.set_defaults(handler=run_router)

    demo = commands.add_parser("make-demo-model", help="write a small random Qwen3 checkpoint")
    demo.add_argument("output_dir")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=run_make_demo_model)

    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    throughput = kinds.add_parser("throughput", help="offline throughput against HF generate")
    add_offline_bench_options(throughput, output_len=64)
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.set_defaults(handler=run_bench)
    latency = kinds.add_parser("latency", help="one request: decode ms/token vs the bandwidth limit and HF")
    add_offline_bench_options(latency, output_len=256)
    latency.add_argument("--hf-output-len", type=int, default=64, help="HF is slow: fewer tokens suffice")
    latency.add_argument(
        "--simulate-acceptance",
        type=float,
        nargs="+",
        default=None,
        help="with --speculative-config: drafts that are right at these rates (simulated: random "
        "weights accept nothing), timed for k = 1..num_speculative_tokens",
    )
    latency.set_defaults(handler=run_latency)
    for name, help_text in OWN_MODULE_BENCHES.items():
        module = importlib.import_module(f"kestrel.bench.{name}")
        parser = kinds.add_parser(name, help=help_text)
        getattr(module, f"add_{name}_bench_options")(parser)
        parser.set_defaults(handler=getattr(module, f"run_{name}_benchmark"))
