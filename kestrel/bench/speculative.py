"""Speculative decoding's gain at batch 1: copy-heavy chat requests (repeat, correct or edit a
text given in the prompt), one at a time, greedy, decoded plainly and then with the
speculative config; both report output tokens/s, and the speculative run its acceptance.
The texts must match token for token: speculation may change speed, never output."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from kestrel.engine.options import add_engine_options
from kestrel.engine.speculative import ForcedAcceptance, SequenceProposer
from kestrel.sampling_params import SamplingParams

PARAGRAPH = (
    "Kestrel serves large language models from checkpoints on a single machine. It batches "
    "requests as they arrive, keeps the keys and values of every running request in pages, "
    "and reuses the pages of prompts it has seen before. When memory runs short it pauses the "
    "newest request and resumes it later, so no request is lost. Bad input gets a clear error "
    "that names what was wrong, and the other requests keep running."
)
TYPOS = PARAGRAPH.replace("machine", "machne").replace("arrive", "arive").replace("memory", "memroy")
CODE = '''def compute(values, weights):
    """The weighted mean of values."""
    if len(values) != len(weights):
        raise ValueError("values and weights differ in length")
    total_weight = sum(weights)
    if total_weight == 0:
        raise ValueError("the weights sum to zero")
    return sum(v * w for v, w in zip(values, weights)) / total_weight
'''
TASKS = (
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Fix the spelling mistakes in this paragraph and write out the corrected paragraph in full:\n\n{TYPOS}",
    f"Rename the function `compute` to `weighted_mean` and write out the whole code:\n\n```python\n{CODE}```",
    f"Rewrite this paragraph with every 'request' replaced by 'query':\n\n{PARAGRAPH}",
)
DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass(frozen=True)
class Run:
    name: str
    output_tokens: int
    seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def chat_prompts(llm, count: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": TASKS[i % len(TASKS)]}], tokenize=False, add_generation_prompt=True
        )
        for i in range(count)
    ]


def timed(llm, name: str, texts: list[str], max_tokens: int) -> tuple[Run, list[list[int]]]:
    """One request at a time; the run and each request's output tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(texts[:1], params.replace(max_tokens=8), use_tqdm=False)  # warm-up
    before = llm.engine.stats()
    outputs, seconds = [], 0.0
    for text in texts:
        start = time.perf_counter()
        output = llm.generate([text], params, use_tqdm=False)[0]
        llm.engine.parts.runtime.synchronize()
        seconds += time.perf_counter() - start
        outputs.append(output.outputs[0].token_ids)
    after = llm.engine.stats()
    counts = [
        getattr(after, name) - getattr(before, name)
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    ]
    return Run(name, sum(len(o) for o in outputs), seconds, *counts), outputs


def run_speculative_benchmark(args: argparse.Namespace) -> int:
    from kestrel import LLM
    from kestrel.engine.options import engine_kwargs

    kwargs = engine_kwargs(args) | {"enable_prefix_caching": False}
    config = kwargs.pop("speculative_config") or DEFAULT_CONFIG
    plain_llm = LLM(args.model, **kwargs)
    texts = chat_prompts(plain_llm, args.num_prompts)
    plain, plain_outputs = timed(plain_llm, "plain", texts, args.max_tokens)
    plain_llm.shutdown()
    speculative, outputs = timed(
        LLM(args.model, **kwargs, speculative_config=config), "speculative", texts, args.max_tokens
    )
    same = sum(a == b for a, b in zip(plain_outputs, outputs))
    speedup = speculative.output_tokens_per_s / plain.output_tokens_per_s
    acceptance = speculative.num_accepted_tokens / max(speculative.num_draft_tokens, 1)
    mean_length = 1 + speculative.num_accepted_tokens / max(speculative.num_drafts, 1)
    print(f"model {args.model}, {len(texts)} requests one at a time, greedy, config {json.dumps(config)}")
    print(f"{'run':<14}{'output tokens':>14}{'seconds':>10}{'output tok/s':>14}")
    for run in (plain, speculative):
        print(f"{run.name:<14}{run.output_tokens:>14}{run.seconds:>10.2f}{run.output_tokens_per_s:>14.1f}")
    print(
        f"speculative / plain: {speedup:.2f}x; drafts accepted {acceptance:.1%}, "
        f"{mean_length:.2f} tokens per verify step; identical outputs {same}/{len(texts)}"
    )
    if args.output_json:
        report = {"runs": [asdict(plain), asdict(speculative)], "speedup": speedup, "identical": same}
        with open(args.output_json, "w") as file:
            json.dump(report | {"acceptance_rate": acceptance, "mean_acceptance_length": mean_length}, file, indent=2)
    return 0 if same == len(texts) else 1


def add_speculative_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    add_engine_options(parser)


# ---- simulated acceptance (a benchmark mode for random weights) ------------------------------


class OracleProposer(SequenceProposer):
    """Drafts for one known sequence: the target model's own greedy continuation (recorded
    by a plain run), each draft token kept right with probability `rate` and otherwise made
    wrong. Random weights accept nothing by themselves; this measures what a verify step
    costs and gains at a chosen acceptance rate, through the engine's real path. Labelled
    as simulated wherever it is reported."""

    def __init__(self, expected: list[int], rate: float, seed: int = 0, follow_anywhere: bool = False) -> None:
        import random

        self.expected, self.rate, self.follow_anywhere = expected, rate, follow_anywhere
        self._random = random.Random(seed)

    def propose_one(self, token_ids: list[int], num_tokens: int) -> tuple[int, ...]:
        start = len(token_ids)
        if start >= len(self.expected):
            return ()
        if token_ids[-1] != self.expected[start - 1] and not self.follow_anywhere:
            return ()  # off the recorded path (the verify rows' rounding chose otherwise)
        truth = self.expected[start : start + num_tokens]
        return tuple(t if self._random.random() < self.rate else t + 1 for t in truth)


def simulated_acceptance_sweep(
    llm, prompt: list[int], output_len: int, rates: list[float], forced: bool = False
) -> list[dict]:
    """Per acceptance rate and draft length k = 1..num_speculative_tokens: ms per output token
    at batch 1 with the oracle's drafts (prefill included), beside k = 0: the same engine
    drafting nothing, timed the same way. `forced`: the oracle drafts the recorded path and
    acceptance is drawn at the rate (`ForcedAcceptance`), for bf16 on a GPU, where verify
    rows round differently from decode rows and a random model's near ties then leave the
    recorded path; otherwise the model's own verification accepts or rejects."""
    import dataclasses

    from kestrel import SamplingParams

    speculation = llm.engine.speculation
    config, proposer = speculation.config, speculation.proposer
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def timed(proposer) -> tuple[float, list[int]]:
        speculation.proposer = proposer
        start = time.perf_counter()
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        llm.engine.parts.runtime.synchronize()
        return (time.perf_counter() - start) * 1e3 / len(output.token_ids), list(prompt) + output.token_ids

    timed(OracleProposer([], 0.0))  # warm-up
    plain_ms, expected = timed(OracleProposer([], 0.0))  # drafts nothing: plain greedy decoding
    rows = [dict(simulated_acceptance=None, k=0, ms_per_output_token=plain_ms, speedup=1.0)]
    for rate in rates:
        for k in range(1, config.num_speculative_tokens + 1):
            speculation.config = dataclasses.replace(config, num_speculative_tokens=k)
            speculation.forced = ForcedAcceptance(rate) if forced else None
            before = dataclasses.replace(speculation.stats)
            ms, tokens = timed(OracleProposer(expected, 1.0 if forced else rate, follow_anywhere=forced))
            drafted = speculation.stats.num_draft_tokens - before.num_draft_tokens
            accepted = speculation.stats.num_accepted_tokens - before.num_accepted_tokens
            rows.append(
                dict(
                    simulated_acceptance=rate,
                    k=k,
                    ms_per_output_token=ms,
                    speedup=plain_ms / ms,
                    measured_acceptance=accepted / drafted if drafted else 0.0,
                    verify_steps=speculation.stats.num_drafts - before.num_drafts,
                    same_tokens=tokens == expected,
                )
            )
    speculation.config, speculation.proposer, speculation.forced = config, proposer, None
    return rows
