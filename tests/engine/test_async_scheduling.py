"""Overlapped (async) scheduling: step N+1 is launched before step N's samples are read,
and the outputs are exactly those of running the steps one after another.

The comparisons of whole runs pin the CPU: the two schedules batch requests into steps
differently, and on a GPU the batch size picks other kernels (split counts, matmul tiles)
whose rounding can flip a near-tied greedy choice of a tiny random model. The device path
of overlapping (pinned transfers, tokens written into graph inputs) is covered by HF parity
on CUDA, which runs overlapped by default."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.engine.test_engine import assert_pool_balanced, prompts

MIXED = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=17, seed=7, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=2),
    SamplingParams(temperature=1.0, max_tokens=9, seed=3, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.5),  # needs every token
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
]


def generate(llm: LLM, batch: list[dict], params: list[SamplingParams]) -> tuple[list, list]:
    """The completions, and the prompt logprobs, of one `generate` call."""
    outputs = llm.generate(batch, params, use_tqdm=False)
    return [o.outputs[0] for o in outputs], [o.prompt_logprobs for o in outputs]


def entries(positions) -> list:
    """Per position: the scored token (the first entry) and every logprob, largest first."""
    return [None if p is None else (next(iter(p)), sorted(lp.logprob for lp in p.values())) for p in positions or []]


def assert_same_outputs(got: tuple[list, list], expected: tuple[list, list]) -> None:
    """Tokens, text and finish reasons identical; logprobs equal up to float rounding. The
    two runs batch requests into steps differently, so on a GPU other kernels may run and
    near-tied alternatives of a tiny random model may swap places: values are compared, not
    ranks."""
    for (a, a_prompt), (b, b_prompt) in zip(zip(*got), zip(*expected), strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.stop_reason == b.stop_reason
        for mine, theirs in [(entries(a.logprobs), entries(b.logprobs)), (entries(a_prompt), entries(b_prompt))]:
            assert len(mine) == len(theirs)
            for m, t in zip(mine, theirs):
                assert (m is None) == (t is None)
                if m is not None:
                    assert m[0] == t[0] and m[1] == pytest.approx(t[1], abs=1e-4)


def stop_on_a_token_greedy_hits(llm: LLM, batch: list[dict]) -> list[SamplingParams]:
    """Params per prompt that stop mid-generation: a stop token id greedy decoding reaches."""
    free = llm.generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    return [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[o.outputs[0].token_ids[4]]) for o in free]


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_overlapped_steps_give_the_outputs_of_sequential_ones(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    batch = prompts(8, 24) + prompts(2, 70, seed=1)
    sequential = LLM(path, device="cpu", page_size=8, max_num_batched_tokens=96, async_scheduling=False)
    overlapped = LLM(path, device="cpu", page_size=8, max_num_batched_tokens=96)
    assert overlapped.engine._overlap and not sequential.engine._overlap
    params = MIXED + stop_on_a_token_greedy_hits(sequential, batch[6:8]) + MIXED[:2]
    expected = generate(sequential, batch, params)
    assert_same_outputs(generate(overlapped, batch, params), expected)
    assert any(o.finish_reason == "stop" for o in expected[0])  # a stop token ended a request early
    assert_pool_balanced(overlapped)


@pytest.mark.parametrize("family", ["qwen3", "qwen3-next"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_overlapped_steps_survive_preemption(checkpoint_dir, family, preemption_mode):
    """Greedy outputs unchanged when a tight pool forces preemption, by recompute or by
    swapping the state (KV pages, and recurrent slots of a hybrid) to host memory and back."""
    path = str(checkpoint_dir(family))
    batch = prompts(8, 40)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sequential = LLM(path, device="cpu", page_size=8, max_num_batched_tokens=128, async_scheduling=False)
    expected = generate(sequential, batch, [greedy] * 8)
    tight = LLM(
        path,
        device="cpu",
        page_size=8,
        max_num_batched_tokens=128,
        max_model_len=128,
        kv_cache_memory_gb=20 * sequential.engine.parts.kv.spec.bytes_per_page() / 2**30,
        preemption_mode=preemption_mode,
    )
    preempted = []
    original = tight.engine._apply

    def apply(plan):
        preempted.extend(plan.preempted)
        original(plan)

    tight.engine._apply = apply
    assert_same_outputs(generate(tight, batch, [greedy] * 8), expected)
    assert preempted  # the pool was tight enough for the planner to preempt
    assert tight.engine.stats().num_preemptions == len(preempted)
    assert tight.engine.num_swapped_out == (len(preempted) if preemption_mode == "swap" else 0)
    assert_pool_balanced(tight)


class StepLog:
    """Wraps an engine's executor to record when steps are launched and read."""

    def __init__(self, llm: LLM) -> None:
        self.events: list[str] = []
        executor = llm.engine.parts.executor
        launch = executor.launch

        def recording_launch(work, masks=None):
            index = sum(event.startswith("launch") for event in self.events)
            self.events.append(f"launch {index}")
            pending = launch(work, masks)
            result = pending.result

            def recording_result():
                self.events.append(f"read {index}")
                return result()

            pending.result = recording_result
            return pending

        executor.launch = recording_launch


def test_the_next_step_is_launched_before_the_last_one_is_read(qwen3_llm):
    log = StepLog(qwen3_llm)
    qwen3_llm.generate(prompts(3, 10), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    launches = [e for e in log.events if e.startswith("launch")]
    assert len(launches) >= 6
    for index in range(len(launches) - 1):  # every step but the last is read after its successor launched
        assert log.events.index(f"launch {index + 1}") < log.events.index(f"read {index}")
    log.events.clear()
    qwen3_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2), use_tqdm=False)
    pairs = list(zip(log.events[::2], log.events[1::2]))
    assert pairs == [(f"launch {i}", f"read {i}") for i in range(len(pairs))]  # penalties: one at a time


def test_abort_while_a_step_runs_and_reuse_of_the_id(qwen3_llm):
    engine = qwen3_llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = qwen3_llm.generate([{"prompt_token_ids": list(range(5, 25))}], greedy, use_tqdm=False)
    engine.add_request("twice", list(range(1, 30)), greedy)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None  # aborted while its next token is being computed
    assert engine.abort_request("twice").outputs[0].finish_reason == "abort"
    engine.add_request("twice", list(range(5, 25)), greedy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].token_ids for o in outputs if o.finished] == [expected[0].outputs[0].token_ids]
    assert_pool_balanced(qwen3_llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronisation exists only on a GPU")
def test_launching_a_step_never_waits_for_the_device(checkpoint_dir):
    """Every host list goes to the device by a pinned, non-blocking copy, and nothing reads the
    device back while a step is queued: otherwise the host would stall on the step before."""
    llm = LLM(str(checkpoint_dir("qwen3")), device="cuda", page_size=8, max_num_batched_tokens=96)
    batch = prompts(6, 30) + prompts(2, 120, seed=2)  # prefill chunks, mixed steps, graph decodes
    params = [MIXED[0], MIXED[1], MIXED[3]] * 2 + [MIXED[0], MIXED[2]]
    expected = generate(llm, batch, params)  # first: compiles kernels and measures the matvec
    executor = llm.engine.parts.executor
    launch = executor.launch

    def launch_checked(work, masks=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(work, masks)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    executor.launch = launch_checked
    assert_same_outputs(generate(llm, batch, params), expected)
