"""The engine end to end on tiny checkpoints: preemption, stops, n, seeds, chat, bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel import LLM, RequestOutput, RequestOutputKind, SamplingParams
from kestrel.core.runner import ModelRunner
from kestrel.core.runtime.base import DeviceRuntime
from kestrel.core.runtime.cpu import CpuRuntime
from kestrel.core.runtime.cuda import CudaRuntime
from kestrel.core.weight_bindings import WeightBindingError
from kestrel.models.registry import UnsupportedArchitectureError
from kestrel.weights.checkpoint import CorruptWeightsError, MissingWeightsError
from tests.checkpoints import HYBRID_FAMILIES

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(count: int, length: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 500, (length,), generator=generator).tolist()} for _ in range(count)]


def hf_greedy(path: str, batch: list[dict], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the full length, as ignore_eos does
    outputs = []
    for prompt in batch:
        ids = torch.tensor([prompt["prompt_token_ids"]])
        generated = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def assert_pool_balanced(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_pages + stats.num_cached_pages + stats.num_used_pages == stats.num_total_pages
    assert stats.num_used_pages == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_state_slots == 0


@pytest.mark.parametrize(
    "family", ["qwen3", "qwen3-moe", "mixtral", "qwen3-next", "qwen3.5", "gemma3", "phi3", "deepseek-v2"]
)
def test_small_kv_pool_preempts_and_still_gives_the_same_outputs(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    batch = prompts(8, 40)
    ample = LLM(path, page_size=8, max_num_batched_tokens=128)
    expected = [o.outputs[0].token_ids for o in ample.generate(batch, GREEDY, use_tqdm=False)]
    # 8 requests x 64 tokens need 64 pages; give the pool 20 (room for about two at a time).
    spec = ample.engine.parts.kv.spec
    tight = LLM(
        path,
        page_size=8,
        max_num_batched_tokens=128,
        max_model_len=128,
        kv_cache_memory_gb=20 * spec.bytes_per_page() / 2**30,
    )
    assert tight.engine.parts.kv.num_pages == 20
    preemptions = []
    original = tight.engine._apply

    def counting_apply(plan):
        preemptions.extend(plan.preempted)
        return original(plan)

    tight.engine._apply = counting_apply
    got = [o.outputs[0].token_ids for o in tight.generate(batch, GREEDY, use_tqdm=False)]
    assert preemptions, "the pool was meant to be too small for every request at once"
    assert got == expected == hf_greedy(path, batch, GREEDY.max_tokens)
    assert_pool_balanced(tight)
    assert_pool_balanced(ample)


def test_prompt_longer_than_max_model_len_is_refused_and_engine_keeps_serving(checkpoint_dir):
    llm = LLM(str(checkpoint_dir("qwen3")), max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, your request has 80 input"):
        llm.generate(prompts(1, 10) + prompts(1, 80), GREEDY, use_tqdm=False)
    assert_pool_balanced(llm)  # nothing from the failed call was admitted
    outputs = llm.generate(
        prompts(2, 10), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [54, 54]  # capped at max_model_len
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": []}, "prompt is empty"),
        ("", "prompt is empty"),
        ({"prompt_token_ids": [1, 10**6]}, "out of range"),
        ({"text": "hi"}, r"prompt keys \['text'\] are not supported"),
        ({"prompt": "hi", "multi_modal_data": {"image": 0}}, r"prompt keys \['multi_modal_data'\] are not supported"),
        ({"prompt_token_ids": [5.0, 6.0]}, r"prompt token ids must be integers, got \[5.0, 6.0\]"),
        ([[1, 2]], "got a prompt of type list"),
        (None, "prompts must be a prompt or a list of prompts, got NoneType"),
        (7, "got int"),
    ],
)
def test_bad_prompts_get_clear_errors(qwen3_llm, prompt, message):
    with pytest.raises((ValueError, TypeError), match=message):
        qwen3_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(qwen3_llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_sampling_params_of_another_type_are_named(qwen3_llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them"):
        qwen3_llm.generate("hi", {"max_tokens": 2}, use_tqdm=False)


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        ([{"content": "hi"}], r"messages\[0\] must be a dict with a 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], r"messages\[1\] \(assistant\) has no 'content'"),
    ],
)
def test_malformed_chat_messages_are_named_before_the_template_runs(qwen3_llm, messages, message):
    with pytest.raises(ValueError, match=message):
        qwen3_llm.chat(messages, GREEDY, use_tqdm=False)


def test_missing_weights_unknown_architecture_and_missing_files(checkpoint_dir, tmp_path):
    source = checkpoint_dir("llama")
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the checkpoint holds two layers
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightBindingError, match=r"missing from the checkpoint: model\.layers\.2\."):
        LLM(str(broken))
    config["architectures"] = ["FancyNewForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        LLM(str(broken))
    config["model_type"] = "fancy_new"  # a model type transformers cannot read either
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"\['FancyNewForCausalLM'\] is not supported"):
        LLM(str(broken))
    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CorruptWeightsError, match=f"cannot read {shard}.*truncated or corrupt"):
        LLM(str(truncated))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(source / "config.json", empty / "config.json")
    with pytest.raises(MissingWeightsError, match="no \\*.safetensors weights"):
        LLM(str(empty))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        LLM(str(tmp_path / "nowhere"))


def test_stop_strings_are_cut_from_the_text(qwen3_llm):
    free = qwen3_llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[5:8]
    assert len(stop) == 3
    stopped = qwen3_llm.generate("The quick brown fox", GREEDY.replace(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stop not in stopped.text
    kept = qwen3_llm.generate(
        "The quick brown fox", GREEDY.replace(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + 3]


def test_stop_token_ids_eos_and_max_tokens(qwen3_llm):
    free = qwen3_llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    stopped = qwen3_llm.generate("Hello", GREEDY.replace(stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", target)
    short = qwen3_llm.generate("Hello", GREEDY.replace(max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == free.token_ids[:5] and short.finish_reason == "length"
    # An eos id that greedy decoding is known to hit stops generation unless ignore_eos.
    engine = qwen3_llm.engine
    original = engine.parts.eos_token_ids
    object.__setattr__(engine.parts, "eos_token_ids", frozenset({target}))
    try:
        eos = qwen3_llm.generate("Hello", GREEDY.replace(ignore_eos=False), use_tqdm=False)[0].outputs[0]
    finally:
        object.__setattr__(engine.parts, "eos_token_ids", original)
    assert eos.token_ids == free.token_ids[: first + 1] and eos.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(qwen3_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = qwen3_llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = ["Hi", "Once upon a time", "The quick brown fox jumps"]
    mixed = qwen3_llm.generate(batch, [others, seeded, others], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == mixed
    other_seed = qwen3_llm.generate("Once upon a time", seeded.replace(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_outputs_per_prompt_in_input_order(qwen3_llm):
    outputs = qwen3_llm.generate(
        ["first prompt", "second"], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5), use_tqdm=False
    )
    assert [o.prompt for o in outputs] == ["first prompt", "second"]
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1


def test_chat_applies_the_template(checkpoint_dir):
    from kestrel.demo import make_demo_model

    demo = make_demo_model(checkpoint_dir("qwen3").parent / "demo")
    llm = LLM(str(demo))
    output = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert output.prompt.startswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert output.prompt_token_ids == llm.get_tokenizer().encode(output.prompt)


def test_incremental_text_equals_full_decode(qwen3_llm):
    output = qwen3_llm.generate("Café 東京 🙂", SamplingParams(temperature=1.0, max_tokens=40, seed=3), use_tqdm=False)
    completion = output[0].outputs[0]
    tokenizer = qwen3_llm.get_tokenizer()
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_abort_frees_pages(qwen3_llm):
    engine = qwen3_llm.engine
    engine.add_request("to-abort", list(range(1, 30)), GREEDY)
    engine.step()
    assert engine.stats().num_used_pages > 0
    output = engine.abort_request("to-abort")
    assert output.outputs[0].finish_reason == "abort"
    assert_pool_balanced(qwen3_llm)


def test_start_up_warm_up_runs_the_largest_steps_and_leaves_nothing_behind(checkpoint_dir, monkeypatch):
    path = str(checkpoint_dir("qwen3"))
    steps = []
    original = ModelRunner.execute

    def recording_execute(self, work):
        steps.append([len(item.token_ids) for item in work])
        return original(self, work)

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    settings = dict(page_size=8, max_num_batched_tokens=96, max_num_seqs=12, max_model_len=64)
    LLM(path, **settings)
    # The CPU runtime sizes its warm-up down: one small prefill, then a small decode batch.
    assert steps == [[32], [1] * 2]
    steps.clear()
    # CUDA's: the largest steps the planner may send, then prefills halving down to 16 tokens.
    monkeypatch.setattr(CpuRuntime, "warm_up_size", DeviceRuntime.warm_up_size)
    monkeypatch.setattr(CpuRuntime, "warm_up_smaller_prefills", CudaRuntime.warm_up_smaller_prefills)
    llm = LLM(path, **settings)
    monkeypatch.undo()
    # A full prefill budget in prompts of at most max_model_len, a full decode batch, then
    # one prompt of each smaller size and one of an odd size.
    assert steps == [[64, 32], [1] * 12, [48], [24], [47]]
    assert_pool_balanced(llm)
    assert llm.engine.stats().num_cached_pages == 0  # throwaway prompts never enter the prefix cache
    assert not llm.engine.parts.runner.sampler._generators
    out = llm.generate(prompts(2, 10), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)


def test_final_only_requests_report_once_cumulative_ones_every_token(qwen3_llm):
    engine = qwen3_llm.engine
    base = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("cumulative", [1, 2, 3], base)
    engine.add_request("final", [1, 2, 3], base.replace(output_kind=RequestOutputKind.FINAL_ONLY))
    reported: dict[str, list[RequestOutput]] = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reported[output.request_id].append(output)
    assert [len(o.outputs[0].token_ids) for o in reported["cumulative"]] == [1, 2, 3, 4, 5]
    assert len(reported["final"]) == 1 and reported["final"][0].finished
    assert reported["final"][0].outputs[0].token_ids == reported["cumulative"][-1].outputs[0].token_ids


def run_reported(engine, params_by_id: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list]:
    for request_id, params in params_by_id.items():
        engine.add_request(request_id, prompt, params)
    reported: dict[str, list[RequestOutput]] = {request_id: [] for request_id in params_by_id}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reported[output.request_id].append(output)
    return reported


def test_delta_outputs_add_up_to_the_cumulative_ones(qwen3_llm):
    free = qwen3_llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[6:9]  # a stop string that greedy decoding is known to produce
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, stop=[stop])
    prompt = qwen3_llm.get_tokenizer().encode("Hello")
    reported = run_reported(
        qwen3_llm.engine,
        {"cumulative": base, "delta": base.replace(output_kind=RequestOutputKind.DELTA)},
        prompt,
    )
    whole, deltas = reported["cumulative"][-1].outputs[0], [o.outputs[0] for o in reported["delta"]]
    assert len(deltas) == len(reported["cumulative"]) > 1 and reported["delta"][-1].finished
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text == free.text[: free.text.index(stop)]
    assert [p for d in deltas for p in d.logprobs] == whole.logprobs
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert all(len(d.token_ids) == 1 for d in deltas)  # one new token per output, never the whole list


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_request_aborted_mid_prefill_frees_its_state_slot(checkpoint_dir, family):
    llm = LLM(str(checkpoint_dir(family)), max_num_batched_tokens=16, max_num_seqs=2)
    engine = llm.engine
    # Prefixes are cached with copies of the recurrent state: one per sequence by default.
    assert engine.parts.kv.prefix_cache is not None and engine.parts.recurrent.num_snapshots == 2
    engine.add_request("long", prompts(1, 60)[0]["prompt_token_ids"], GREEDY)
    engine.step()  # the first 16 of 60 prompt tokens
    assert engine.stats().num_used_state_slots == 1
    engine.abort_request("long")
    assert_pool_balanced(llm)
    assert engine.parts.recurrent.free_capacity() == 2


def test_float8_kv_cache_holds_four_times_the_float32_tokens_and_stays_close(checkpoint_dir):
    path = str(checkpoint_dir("qwen3"))
    exact = LLM(path, kv_cache_memory_gb=0.002)
    narrow = LLM(path, kv_cache_memory_gb=0.002, kv_cache_dtype="fp8")
    assert narrow.engine.parts.kv.spec.dtype == torch.float8_e4m3fn
    assert narrow.engine.parts.kv.num_pages // 4 == exact.engine.parts.kv.num_pages
    # Teacher-forced logprobs of the same tokens (prompt logprobs read the prefix back from
    # the pool), so both runs score the same text and only the rounding of K and V differs.
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    batch = prompts(3, 48)

    def prompt_logprobs(llm: LLM) -> torch.Tensor:
        outputs = llm.generate(batch, params, use_tqdm=False)
        return torch.tensor(
            [
                position[token].logprob
                for output in outputs
                for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])
            ]
        )

    # e4m3 keeps 3 mantissa bits (rounding errors up to 6%): close, not equal.
    difference = (prompt_logprobs(narrow) - prompt_logprobs(exact)).abs()
    assert 0 < difference.mean() < 0.05 and difference.max() < 0.3, (difference.mean(), difference.max())


def test_unknown_kv_cache_dtype_is_a_clear_error(checkpoint_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int4'"):
        LLM(str(checkpoint_dir("qwen3")), kv_cache_dtype="int4")


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_bfloat16_recurrent_state_halves_its_bytes_and_stays_close(checkpoint_dir, family):
    """`mamba_ssm_cache_dtype="bfloat16"`: the recurrent matrices stored in bf16 (read widened,
    computed in float32, rounded when saved) between prefill chunks and every decode step."""
    path = str(checkpoint_dir(family))
    common = dict(max_num_batched_tokens=16, page_size=8)  # prompts split into several chunks
    exact, narrow = LLM(path, **common), LLM(path, **common, mamba_ssm_cache_dtype="bfloat16")
    wide_spec, narrow_spec = exact.engine.parts.recurrent.spec, narrow.engine.parts.recurrent.spec
    assert (wide_spec.state_dtype, narrow_spec.state_dtype) == (torch.float32, torch.bfloat16)
    state_bytes = wide_spec.num_layers * wide_spec.num_heads * wide_spec.key_dim * wide_spec.value_dim * 2
    assert wide_spec.bytes_per_slot() - narrow_spec.bytes_per_slot() == state_bytes
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    batch = prompts(3, 40)
    expected = exact.generate(batch, params, use_tqdm=False)
    got = narrow.generate(batch, params, use_tqdm=False)
    differences = []
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for token, wide, half in zip(want.outputs[0].token_ids, want.outputs[0].logprobs, have.outputs[0].logprobs):
            differences.append(abs(wide[token].logprob - half[token].logprob))
    # bf16 keeps 8 mantissa bits: each save rounds the state by up to 2^-9 of its size.
    assert 0 < max(differences) < 5e-3, max(differences)


def test_unknown_ssm_cache_dtype_is_a_clear_error(checkpoint_dir, caplog):
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32, bfloat16, float16"):
        LLM(str(checkpoint_dir("qwen3-next")), mamba_ssm_cache_dtype="fp8")
    with caplog.at_level("WARNING", logger="kestrel"):  # asked of a model without that state: said so
        LLM(str(checkpoint_dir("qwen3")), mamba_ssm_cache_dtype="bfloat16")
    assert "mamba_ssm_cache_dtype='bfloat16' has no effect: Qwen3ForCausalLM keeps no recurrent state" in caplog.text


def test_progress_bar_shows_token_speeds(qwen3_llm, capsys):
    qwen3_llm.generate(["one", "two"], GREEDY, use_tqdm=True)
    shown = capsys.readouterr().err
    assert re.search(r"2/2 .*est\. speed input: [\d.]+ toks/s, output: [\d.]+ toks/s", shown)


def test_allowed_token_ids_and_logit_bias_steer_sampling(qwen3_llm):
    allowed = qwen3_llm.generate(
        "Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=[7, 9]), use_tqdm=False
    )[0].outputs[0]
    assert set(allowed.token_ids) <= {7, 9} and len(allowed.token_ids) == 12
    free = qwen3_llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    target = next(t for t in range(100, 200) if t not in free.token_ids)
    biased = qwen3_llm.generate("Hello", GREEDY.replace(logit_bias={target: 100}), use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [target] * len(free.token_ids)
    banned = free.token_ids[0]
    avoided = qwen3_llm.generate("Hello", GREEDY.replace(logit_bias={banned: -100}), use_tqdm=False)[0].outputs[0]
    assert avoided.token_ids[0] != banned
    with pytest.raises(ValueError, match="out of range"):
        qwen3_llm.generate("Hello", GREEDY.replace(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"biases in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 1000})


def test_bad_words_are_never_generated(qwen3_llm):
    tokenizer = qwen3_llm.get_tokenizer()
    free = qwen3_llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    # A word of the free text that is one token as it stands after a space.
    word = next(
        text
        for token in free.token_ids
        if (text := tokenizer.decode([token])).startswith(" ")
        and text.strip().isalpha()
        and tokenizer.encode(text, add_special_tokens=False) == [token]
    )
    banned = qwen3_llm.generate("The quick brown fox", GREEDY.replace(bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert tokenizer.encode(word, add_special_tokens=False)[0] not in banned.token_ids
    assert banned.token_ids != free.token_ids
