"""The cost of structured outputs: the same concurrent chat requests, every one constrained by
a JSON schema, then none, at the same number of output tokens per request.

Constrained answers end when their JSON does, so they run first; the free run then asks each
request for as many tokens as its constrained twin wrote (ignoring EOS), so both runs do the
same work, and both report output tokens/s. The
schema is a list of records (strings, bounded integers, enums), so masks change at every
token, as with real schemas.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from kestrel.engine.options import add_engine_options
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams

RECORDS = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                    "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
                },
                "required": ["name", "age", "role"],
            },
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["people"],
}
TOPICS = ["a startup", "a hospital", "a school", "a band", "a lab", "a newsroom", "a bakery", "a theatre"]


@dataclass(frozen=True)
class Run:
    name: str
    num_requests: int
    output_tokens: int
    seconds: float
    mask_steps: int = 0
    mask_seconds: float = 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def prompts(llm, count: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List six people who work at {TOPICS[i % len(TOPICS)]}, as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(count)
    ]


def timed(llm, name: str, texts: list[str], params: list[SamplingParams]) -> tuple[Run, list[int]]:
    """The run, and each request's number of output tokens."""
    structured = llm.engine.structured
    steps, mask_seconds = structured.num_mask_steps, structured.mask_seconds
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    llm.engine.parts.runtime.synchronize()
    seconds = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    masks = structured.num_mask_steps - steps, structured.mask_seconds - mask_seconds
    return Run(name, len(texts), sum(lengths), seconds, *masks), lengths


def run_structured_benchmark(args: argparse.Namespace) -> int:
    from kestrel import LLM
    from kestrel.engine.options import engine_kwargs

    # Both runs send the same prompts: with prefix caching the second would skip their prefill.
    llm = LLM(args.model, **(engine_kwargs(args) | {"enable_prefix_caching": False}))
    texts = prompts(llm, args.num_prompts)
    spec = StructuredOutputsParams(json=RECORDS)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
        for i in range(len(texts))
    ]
    timed(llm, "warm-up", texts[:2], constrained[:2])  # compiles the grammar: its cost is reported apart
    constrained_run, lengths = timed(llm, "json_schema", texts, constrained)
    free = [SamplingParams(temperature=1.0, seed=0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs = [constrained_run, timed(llm, "unconstrained", texts, free)[0]]
    mean_len = round(sum(lengths) / len(lengths))
    grammars = llm.engine.structured.grammars
    print(f"model {args.model}, {len(texts)} concurrent requests, {mean_len} output tokens each on average")
    print(f"{'run':<16}{'output tok/s':>14}{'seconds':>10}{'mask ms/step':>14}")
    for run in runs:
        per_step = 1e3 * run.mask_seconds / run.mask_steps if run.mask_steps else 0.0
        print(f"{run.name:<16}{run.output_tokens_per_s:>14.1f}{run.seconds:>10.2f}{per_step:>14.3f}")
    ratio = runs[0].output_tokens_per_s / runs[1].output_tokens_per_s
    print(f"constrained / unconstrained: {ratio:.3f}; grammar compiled once in {1e3 * grammars.compile_seconds:.1f} ms")
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump({"runs": [asdict(r) for r in runs], "ratio": ratio}, file, indent=2)
    return 0


def add_structured_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=400, help="a bound on each constrained answer")
    parser.add_argument("--output-json", default=None)
    add_engine_options(parser)
