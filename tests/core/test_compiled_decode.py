"""Decode steps compiled on the CPU (`compilation_config` mode 3): the same greedy tokens as
Hugging Face, logprobs as close as eager steps get, through every way the mirrors the compiled
steps read change: a batch that grows and shrinks (steps of other sizes run eagerly between
compiled ones), contexts that outgrow the mirrors' capacity."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel import LLM, SamplingParams
from kestrel.engine.compilation import CompilationConfig
from tests.test_hf_parity import hf_greedy

# Past the mirrors' first capacity (the longest row + 64 keys), so they are regathered.
NEW_TOKENS = 90
PROMPT_LENGTHS = (5, 40, 17)


# GPT-OSS: sinks, sliding-window layers and experts (gathered per choice when compiled).
# Qwen3-Next: recurrent state (its torch path traced whole) beside attention and experts.
# Llama compiles steps of 1 row too: the compiled steps check no guards, so each must keep
# to its own size.
@pytest.mark.parametrize("family, sizes", [("llama", [1, 2]), ("gpt-oss", [2]), ("qwen3-next", [2])])
def test_compiled_decode_steps_match_hf(family, sizes, checkpoint_dir):
    path = checkpoint_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    # Steps of 2 rows compiled, of 1 row eager (or compiled too). Different lengths make the
    # batch shrink as requests finish; the max_num_seqs of 2 makes the third join later.
    llm = LLM(
        str(path),
        dtype="float32",
        max_num_seqs=2,
        kv_cache_memory_gb=0.25,
        compilation_config={"mode": 3, "compile_sizes": sizes},
    )
    runner = llm.engine.parts.runner
    assert runner.graphs is not None and runner.graphs.buckets == sizes
    compiled_steps = []
    run_compiled = runner.graphs.run
    runner.graphs.run = lambda layout, *args: compiled_steps.append(layout) or run_compiled(layout, *args)
    lengths = (NEW_TOKENS, NEW_TOKENS // 2, NEW_TOKENS // 3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(compiled_steps) >= NEW_TOKENS // 2 - 1  # while two requests decode together
    for prompt, output, length in zip(prompts, outputs, lengths):
        expected, scores = hf_greedy(hf, prompt, length)
        completion = output.outputs[0]
        assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens"
        for position, (token, score) in enumerate(zip(expected, scores)):
            want = float(score[token])
            assert completion.logprobs[position][token].logprob == pytest.approx(want, abs=1e-4)


def test_compiled_steps_with_speculation_keep_the_greedy_tokens(checkpoint_dir):
    """Verify chunks run eagerly (a compiled row reads its own mirror row, which lacks the keys
    its chunk's earlier rows store in the same step); plain decode steps stay compiled."""
    path = str(checkpoint_dir("llama"))
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9] * 8}  # repeats: prompt lookup drafts plenty
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=0)
    plain = LLM(path, dtype="float32", kv_cache_memory_gb=0.1).generate(prompt, params, use_tqdm=False)
    speculative = LLM(
        path,
        dtype="float32",
        kv_cache_memory_gb=0.1,
        compilation_config={"mode": 3, "compile_sizes": [2]},  # its verify chunks here: 2 rows
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    got, want = speculative.generate(prompt, params, use_tqdm=False)[0].outputs[0], plain[0].outputs[0]
    assert speculative.engine.stats().spec_decode_num_accepted_tokens > 0
    assert got.token_ids == want.token_ids
    for position, token in enumerate(want.token_ids):  # this model repeats a token: logprobs tell
        assert got.logprobs[position][token].logprob == pytest.approx(want.logprobs[position][token].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("value", "mode", "sizes"),
    [
        (3, 3, (1,)),
        ("3", 3, (1,)),
        ('{"mode": 3, "compile_sizes": [4, 1, 4]}', 3, (1, 4)),
        ({"level": 0}, 0, (1,)),
        ({}, 0, (1,)),
    ],
)
def test_compilation_config_reads_vllm_spellings(value, mode, sizes):
    config = CompilationConfig.parse(value)
    assert (config.mode, config.compile_sizes) == (mode, sizes)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1, "mode 1 is not supported"),
        ({"mode": 3, "cudagraph_capture_sizes": [1]}, "unknown compilation_config fields: cudagraph_capture_sizes"),
        ({"mode": 3, "compile_sizes": [0]}, "compile_sizes must be positive"),
        ({"mode": 3, "level": 0}, "both mode and level"),
        ("{mode: 3}", "not valid JSON"),
        ({"compile_sizes": [4]}, "give mode 3 too"),
    ],
)
def test_compilation_config_refuses_what_it_cannot_do(value, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig.parse(value)


def test_models_whose_state_does_not_compile_are_refused_by_name(checkpoint_dir):
    with pytest.raises(ValueError, match="state groups 'kv' .* do not join compiled steps"):
        LLM(str(checkpoint_dir("deepseek-v2")), compilation_config=3, kv_cache_memory_gb=0.05)


def test_compile_sizes_past_max_num_seqs_are_refused(checkpoint_dir):
    config = {"mode": 3, "compile_sizes": [1, 8]}
    with pytest.raises(ValueError, match=r"compile_sizes \[8\] exceed max_num_seqs \(4\)"):
        LLM(str(checkpoint_dir("llama")), max_num_seqs=4, compilation_config=config, kv_cache_memory_gb=0.05)


def test_compiled_steps_and_eager_mode_are_not_asked_for_together(checkpoint_dir):
    with pytest.raises(ValueError, match="enforce_eager asks for none"):
        LLM(str(checkpoint_dir("llama")), enforce_eager=True, compilation_config=3, kv_cache_memory_gb=0.05)


def test_compiled_hybrid_steps_with_prefix_caching_keep_the_greedy_tokens(checkpoint_dir):
    """A compiled step cannot ask the host which rows save a snapshot (their ids change between
    replays): it writes every row's save slot, its own slot where there is none. Conversations
    whose second turns start from the state snapshots their first turns' prompts left (every
    16 tokens here), then decode in compiled steps: the same tokens as an engine that caches
    nothing."""
    path = str(checkpoint_dir("qwen3-next"))
    common = dict(dtype="float32", max_num_seqs=2, page_size=8, state_snapshot_interval=16)
    plain = LLM(path, enable_prefix_caching=False, **common)
    compiled_steps = {"mode": 3, "compile_sizes": [2]}
    compiled = LLM(path, compilation_config=compiled_steps, num_state_snapshots=4, kv_cache_memory_gb=0.05, **common)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    first = [list(range(30, 70)), list(range(100, 137))]
    answers = tokens(compiled, first)
    assert answers == tokens(plain, first)
    second = [p + a + [7, 8, 9] for p, a in zip(first, answers)]
    hits = compiled.engine.stats().prefix_cache_hits
    assert tokens(compiled, second) == tokens(plain, second)
    assert compiled.engine.stats().prefix_cache_hits - hits >= 64  # both second turns from a kept state
