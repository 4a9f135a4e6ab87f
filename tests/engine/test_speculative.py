"""Speculative decoding (n-gram prompt lookup): the configuration, the proposer, acceptance,
and the engine's outputs, which must be exactly those of decoding one token at a time."""

from __future__ import annotations

import re

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.speculative import NgramProposer, SpeculationStats, SpeculativeConfig, kept_samples
from tests.checkpoints import FAMILIES, HYBRID_FAMILIES
from tests.engine.test_async_scheduling import assert_same_outputs, generate
from tests.engine.test_engine import assert_pool_balanced

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- configuration -----------------------------------------------------------------------


def test_config_follows_vllm_defaults_and_json():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": None}).prompt_lookup_min == 3
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}) == (
        SpeculativeConfig("ngram", 2, 4, 4)
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({**NGRAM, "draft_tensor_parallel_size": 1}, "unknown speculative_config fields: draft_tensor_parallel_size"),
        ({**NGRAM, "method": "eagle"}, "method 'eagle' is not supported yet"),
        ({**NGRAM, "method": "lookahead"}, "unknown speculative_config method 'lookahead'"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 16]"),
        ({**NGRAM, "prompt_lookup_min": 4}, "1 <= min <= max"),
        ({**NGRAM, "model": "draft"}, "takes no 'model'"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_config_errors_name_what_is_wrong(value, message):
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.parse(value)
    assert message in str(error.value)


# ---- proposing and accepting ---------------------------------------------------------------


def test_ngram_takes_the_longest_suffix_match_then_the_latest():
    proposer = NgramProposer(1, 3)
    # "7 8 9" occurred once (followed by 1 2); "9" alone occurred later (followed by 5).
    assert proposer.propose_one([7, 8, 9, 1, 2, 3, 9, 5, 6, 7, 8, 9], 3) == (1, 2, 3)
    assert proposer.propose_one([4, 9, 5, 6, 9, 7, 0, 9], 2) == (7, 0)  # only "9" matches: the latest
    assert proposer.propose_one([1, 2, 3, 4], 3) == ()  # nothing repeats
    assert proposer.propose_one([5, 5], 4) == (5,)  # the continuation stops at the sequence's end
    assert NgramProposer(2, 2).propose_one([1, 2, 3, 1, 4], 2) == ()  # a 1-gram match is below the minimum


def test_kept_samples_stop_after_the_first_mismatch():
    assert kept_samples([5, 6, 7, 8], [5, 6, 7]) == 4  # all drafts stand, plus the bonus sample
    assert kept_samples([5, 9, 7, 8], [5, 6, 7]) == 2  # the correction replaces the second draft
    assert kept_samples([1, 6, 7, 8], [5, 6, 7]) == 1


def test_stats_count_per_position():
    stats = SpeculationStats()
    stats.record(4, 2)
    stats.record(3, 3)
    assert stats.accepted_per_position == [2, 2, 1, 0]
    assert stats.acceptance_rate == 5 / 7 and stats.mean_acceptance_length == 3.5


# ---- the engine ------------------------------------------------------------------------------


def looping_prompts(count: int) -> list[dict]:
    """Prompts that repeat a phrase: the n-gram proposer finds drafts in them at once."""
    torch.manual_seed(5)
    phrases = [torch.randint(20, 500, (int(torch.randint(3, 7, ()).item()),)).tolist() for _ in range(count)]
    return [{"prompt_token_ids": phrase * 4 + phrase[:2]} for phrase in phrases]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=19, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, min_tokens=3, prompt_logprobs=1),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
]


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    path = str(checkpoint_dir("qwen3"))
    common = dict(device="cpu", max_num_batched_tokens=64, page_size=8)
    plain = LLM(path, **common)
    speculative = LLM(path, **common, speculative_config=NGRAM)
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in HYBRID_FAMILIES and f != "qwen3"])
def test_greedy_outputs_identical_with_speculation(family, checkpoint_dir):
    path = str(checkpoint_dir(family))
    batch = looping_prompts(5)
    plain = generate(LLM(path, device="cpu"), batch, PARAMS)
    llm = LLM(path, device="cpu", speculative_config=NGRAM)
    assert_same_outputs(generate(llm, batch, PARAMS), plain)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0
    # The tiny random Llama 4 does not repeat these prompts, so its drafts are checked and
    # rejected (rollback exercised); every other family accepts some.
    assert stats.spec_decode_num_accepted_tokens > 0 or family == "llama4"
    # Again, from a warm prefix cache.
    assert_same_outputs(generate(llm, batch, PARAMS), plain)
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_pool_balanced(llm)


def test_verify_chunks_split_by_the_token_budget_and_stop_mid_draft(engines):
    plain, speculative = engines
    batch = looping_prompts(8)
    expected = generate(plain, batch, PARAMS + PARAMS[:3])
    assert_same_outputs(generate(speculative, batch, PARAMS + PARAMS[:3]), expected)
    # A stop token inside an accepted run of drafts ends the output there.
    free = plain.generate(batch[:3], PARAMS[0], use_tqdm=False)
    stops = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[o.outputs[0].token_ids[9]]) for o in free]
    assert_same_outputs(generate(speculative, batch[:3], stops), generate(plain, batch[:3], stops))
    assert_pool_balanced(speculative)


def test_request_metrics_count_drafts(engines):
    """An oracle drafting the model's own greedy path, each draft right half the time: the
    request's metrics count what it drafted and what stood."""
    from kestrel.bench.speculative import OracleProposer

    plain, speculative = engines
    prompt = looping_prompts(1)[0]["prompt_token_ids"]
    (greedy,) = plain.generate({"prompt_token_ids": prompt}, PARAMS[0], use_tqdm=False)
    engine = speculative.engine
    proposer = engine.speculation.proposer
    engine.speculation.proposer = OracleProposer(prompt + greedy.outputs[0].token_ids, 0.5)
    try:
        engine.add_request("m", prompt, PARAMS[0])
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
    finally:
        engine.speculation.proposer = proposer
    assert final.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert final.metrics.num_draft_tokens > 0
    assert 0 < final.metrics.num_accepted_tokens < final.metrics.num_draft_tokens


def record_preemptions(llm: LLM) -> list[str]:
    """The ids of the requests the engine's plans preempt from now on, as they happen."""
    preemptions = []
    original = llm.engine._apply
    llm.engine._apply = lambda plan: (preemptions.extend(plan.preempted), original(plan))[1]
    return preemptions


def run_in_a_tight_pool(path: str, config: dict, budget_pages: float) -> tuple[LLM, list[str]]:
    """Six looping requests of 40 greedy tokens (about 48 pages of 8 tokens at once) with
    speculation, in a KV budget of `budget_pages` pages: outputs identical to an ample pool
    without it. Returns the tight engine and the ids it preempted."""
    batch = looping_prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 6
    ample = LLM(path, device="cpu", page_size=8)
    expected = generate(ample, batch, params)
    budget = budget_pages * ample.engine.parts.kv.spec.bytes_per_page() / 2**30
    tight = LLM(path, device="cpu", page_size=8, kv_cache_memory_gb=budget, speculative_config=config)
    preemptions = record_preemptions(tight)
    assert_same_outputs(generate(tight, batch, params), expected)
    return tight, preemptions


def test_preemption_under_speculation_keeps_outputs(checkpoint_dir):
    # 6 requests x ~60 tokens need ~48 pages; the pool has 16 (drafts take pages too).
    tight, preemptions = run_in_a_tight_pool(str(checkpoint_dir("qwen3")), NGRAM, 16)
    assert preemptions, "the pool was meant to be too small for every request at once"
    assert tight.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_pool_balanced(tight)


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_hybrid_models_speculate_with_the_state_before_a_verify_kept(family, checkpoint_dir):
    """A verify chunk writes its recurrent state to a spare slot: all drafts standing, the
    spare becomes the request's; any rejected, the state before the chunk stands and the
    accepted tokens are computed again with the next drafts. Greedy outputs identical, with
    split chunks, a warm prefix cache (second round) and both outcomes seen."""
    path = str(checkpoint_dir(family))
    batch = looping_prompts(5)
    common = dict(device="cpu", max_num_batched_tokens=40, page_size=8, state_snapshot_interval=16)
    plain = LLM(path, **common)
    llm = LLM(path, **common, speculative_config=NGRAM)
    for _ in range(2):
        assert_same_outputs(generate(llm, batch, PARAMS), generate(plain, batch, PARAMS))
    assert llm.engine.stats().prefix_cache_hits > 0
    # A random hybrid model rarely repeats itself: an oracle drafts its own greedy tokens,
    # all right (every verify's state kept) or half right (rejections step back).
    from kestrel.bench.speculative import simulated_acceptance_sweep

    rows = simulated_acceptance_sweep(llm, looping_prompts(1)[0]["prompt_token_ids"], 24, [1.0, 0.5])
    for row in rows[1:]:
        assert row["same_tokens"], row
    assert all(row["measured_acceptance"] == 1.0 for row in rows[1:5])
    assert all(0 < row["measured_acceptance"] < 1 for row in rows[6:9])
    recurrent = llm.engine.parts.recurrent
    assert recurrent.num_used_slots == 0 and recurrent.free_capacity() == recurrent.total_capacity()
    assert_pool_balanced(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: verify rows join them on CUDA only")
@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_hybrid_verify_steps_replay_the_decode_graphs(family, checkpoint_dir):
    """A hybrid model's verify chunks run as rows of the captured decode graphs (the recurrent
    state folds each chunk's rows in order): greedy outputs identical to eager plain decoding,
    with all drafts standing and with some rejected."""
    from kestrel.bench.speculative import simulated_acceptance_sweep

    path = str(checkpoint_dir(family))
    common = dict(device="cuda", dtype="float32", page_size=16, kv_cache_memory_gb=0.25, max_num_seqs=16)
    batch = looping_prompts(4)
    expected = generate(LLM(path, enforce_eager=True, **common), batch, PARAMS[:4])
    llm = LLM(path, speculative_config=NGRAM, **common)
    replays = []
    graphs = llm.engine.parts.runner.graphs
    original = graphs.run
    graphs.run = lambda layout, *a: (replays.append(layout), original(layout, *a))[1]
    assert_same_outputs(generate(llm, batch, PARAMS[:4]), expected)
    rows = simulated_acceptance_sweep(llm, looping_prompts(1)[0]["prompt_token_ids"], 24, [1.0, 0.5])
    assert all(row["same_tokens"] for row in rows[1:]), rows
    verify_rows = any(a.page_ids == b.page_ids for layout in replays for a, b in zip(layout.chunks, layout.chunks[1:]))
    assert verify_rows, "no verify step replayed a graph"
    assert_pool_balanced(llm)


def test_hybrid_speculation_under_preemption_keeps_outputs(checkpoint_dir):
    tight, preemptions = run_in_a_tight_pool(str(checkpoint_dir("qwen3-next")), NGRAM, 16)
    assert preemptions and tight.engine.stats().spec_decode_num_drafts > 0
    assert_pool_balanced(tight)


def test_a_hybrid_target_takes_an_attention_only_draft_model(checkpoint_dir):
    path = str(checkpoint_dir("qwen3-next"))
    batch = looping_prompts(3)
    expected = generate(LLM(path, device="cpu"), batch, PARAMS[:3])
    llm = LLM(path, device="cpu", speculative_config=draft_config(checkpoint_dir("qwen3")))
    assert_same_outputs(generate(llm, batch, PARAMS[:3]), expected)
    assert llm.engine.stats().spec_decode_num_drafts > 0
    assert_pool_balanced(llm)
    assert_draft_pool_empty(llm)


# ---- sampling: the target model's distribution, exactly ------------------------------------


def peaked_checkpoint(source, directory):
    """The tiny model with its output layer scaled up: its next-token distributions become
    peaked but not one-hot, so at temperature 1 drafts are both accepted and rejected."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return str(directory)


def chi_square_p_value(first: list[int], second: list[int], min_count: int = 10) -> float:
    """Two-sample chi-square test of equal distributions over tokens (equal sample sizes);
    tokens seen fewer than `min_count` times in both samples together are pooled."""
    tokens = sorted(set(first) | set(second))
    counts = torch.tensor([[first.count(t), second.count(t)] for t in tokens], dtype=torch.float64)
    rare = counts.sum(1) < min_count
    counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
    counts = counts[counts.sum(1) > 0]
    statistic = ((counts[:, 0] - counts[:, 1]) ** 2 / counts.sum(1)).sum()
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def sampled_ids(llm: LLM, prompt: dict, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]


def test_sampled_tokens_follow_the_target_distribution(checkpoint_dir, tmp_path):
    path = peaked_checkpoint(checkpoint_dir("qwen3"), tmp_path)
    llm = LLM(path, device="cpu", speculative_config=NGRAM)
    # The model's own greedy continuation, which a tiny random model soon repeats in a cycle:
    # the n-gram proposer then drafts what the model is likely to sample.
    seed = looping_prompts(1)[0]["prompt_token_ids"]
    greedy = llm.generate({"prompt_token_ids": seed}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prompt = {"prompt_token_ids": seed + greedy[0].outputs[0].token_ids}
    num_samples, length = 600, 6
    params = [SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=s) for s in range(num_samples)]
    plain = sampled_ids(LLM(path, device="cpu"), prompt, params)
    speculated = sampled_ids(llm, prompt, params)
    stats = llm.engine.stats()
    # Both outcomes of a draft happen hundreds of times, so the test sees acceptance and rejection.
    accepted = stats.spec_decode_num_accepted_tokens
    assert accepted > 200 and stats.spec_decode_num_draft_tokens - accepted > 200
    for position in range(1, length):  # position 0 comes from the prompt's step, not a verify
        p_value = chi_square_p_value([t[position] for t in plain], [t[position] for t in speculated])
        assert p_value > 1e-3, f"position {position}: the distributions differ (p = {p_value:.2g})"
    # The test has the power to see a wrong distribution: the plain run at another temperature.
    hotter = [SamplingParams(temperature=2.0, max_tokens=length, ignore_eos=True, seed=s) for s in range(num_samples)]
    other = sampled_ids(llm, prompt, hotter)
    assert chi_square_p_value([t[2] for t in plain], [t[2] for t in other]) < 1e-3


def test_simulated_acceptance_drafts_at_the_chosen_rate(engines):
    """The benchmark mode for random weights: an oracle drafts the model's own greedy tokens,
    each right with the chosen probability; all right means every draft stands."""
    from kestrel.bench.speculative import simulated_acceptance_sweep

    _, speculative = engines
    prompt = looping_prompts(1)[0]["prompt_token_ids"]
    rows = simulated_acceptance_sweep(speculative, prompt, 16, [1.0, 0.0])
    assert [(r["simulated_acceptance"], r["k"]) for r in rows] == [(None, 0)] + [
        (rate, k) for rate in (1.0, 0.0) for k in (1, 2, 3, 4)
    ]
    for row in rows[1:]:
        assert row["same_tokens"]
        assert row["measured_acceptance"] == row["simulated_acceptance"]
    # All right: each verify step yields k + 1 tokens (the first token comes from the prompt).
    assert rows[4]["verify_steps"] == -(-15 // 5)
    assert speculative.engine.speculation.config.num_speculative_tokens == 4  # the engine's own again
    # Forced acceptance (for bf16 GPUs): drafts stand at the drawn rate, whatever the model says.
    forced = simulated_acceptance_sweep(speculative, prompt, 16, [0.5], forced=True)
    assert all(row["same_tokens"] for row in forced[1:])  # the oracle's drafts are the model's own
    assert all(0 < row["measured_acceptance"] < 1 for row in forced[2:])
    assert speculative.engine.speculation.forced is None
    assert isinstance(speculative.engine.speculation.proposer, NgramProposer)


def test_stop_strings_and_constrained_requests_beside_drafting_ones(engines):
    """A stop string inside accepted drafts ends the text there; a constrained request in the
    same batch decodes one token at a time and still holds its grammar."""
    from kestrel.sampling_params import StructuredOutputsParams

    plain, speculative = engines
    batch = looping_prompts(3)
    free = plain.generate(batch[:1], PARAMS[0], use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 :][:3]
    regex = StructuredOutputsParams(regex="[a-c]{3,6}")
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=regex),
        PARAMS[0],
    ]
    expected = generate(plain, batch, params)
    assert_same_outputs(generate(speculative, batch, params), expected)
    assert expected[0][0].finish_reason == "stop" and expected[0][0].stop_reason == stop


def test_constrained_requests_draft_within_their_grammar(engines):
    """A grammar that repeats lets the n-gram drafts stand: drafts are cut where the grammar
    would refuse one, each verify row is masked after the drafts before it, and greedy
    answers are those of plain decoding (a sampled one draws its random numbers differently,
    so only its grammar is checked)."""
    from kestrel.sampling_params import StructuredOutputsParams

    plain, speculative = engines
    batch = looping_prompts(4)
    specs = [StructuredOutputsParams(regex="(abc ){3,9}end"), StructuredOutputsParams(choice=["yes yes yes", "no"])]
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=specs[0]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=specs[0]),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=specs[1]),
        PARAMS[0],
    ]
    before = speculative.engine.stats().spec_decode_num_accepted_tokens
    greedy = [0, 2, 3]
    expected = generate(plain, [batch[i] for i in greedy], [params[i] for i in greedy])
    got = generate(speculative, batch, params)
    assert_same_outputs(([got[0][i] for i in greedy], [got[1][i] for i in greedy]), expected)
    for completion in got[0][:2]:
        assert re.fullmatch("(abc ){3,9}end", completion.text), completion.text
    assert got[0][2].text in ("yes yes yes", "no")
    (alone,) = speculative.generate(batch[:1], params[:1], use_tqdm=False)
    assert alone.metrics.num_accepted_tokens > 0, "the constrained request's drafts were meant to stand"
    assert speculative.engine.stats().spec_decode_num_accepted_tokens > before
    assert_pool_balanced(speculative)


# ---- a draft model ---------------------------------------------------------------------------


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def assert_draft_pool_empty(llm: LLM) -> None:
    draft = llm.engine.parts.draft
    assert draft.kv.num_used_pages == 0, "a finished request's draft pages were not freed"


def test_a_draft_model_that_is_the_target_has_every_greedy_draft_accepted(checkpoint_dir):
    """The draft pool catches up on each prompt and on each verify's outcome, so the target
    drafting for itself proposes exactly its own greedy tokens (the draft knows no penalties:
    the request with them is left out)."""
    path = checkpoint_dir("qwen3")
    batch = [{"prompt_token_ids": p["prompt_token_ids"][:-3]} for p in looping_prompts(4)]
    params = PARAMS[:2] + PARAMS[3:]
    common = dict(device="cpu", max_num_batched_tokens=64, page_size=8)
    expected = generate(LLM(str(path), **common), batch, params)
    llm = LLM(str(path), **common, speculative_config=draft_config(path, 4))
    assert_same_outputs(generate(llm, batch, params), expected)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 30
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
    assert_pool_balanced(llm)
    assert_draft_pool_empty(llm)


@pytest.mark.parametrize("target", ["qwen3", "qwen3-moe"])
def test_greedy_outputs_identical_with_another_draft_model(checkpoint_dir, target):
    """A different model of the same tokenizer drafts: most drafts are wrong, none may change
    the output, long prompts are fed to the draft over several steps."""
    path = str(checkpoint_dir(target))
    batch = looping_prompts(4) + [{"prompt_token_ids": list(range(30, 130))}]
    common = dict(device="cpu", max_num_batched_tokens=48, page_size=8)
    expected = generate(LLM(path, **common), batch, PARAMS)
    llm = LLM(path, **common, speculative_config=draft_config(checkpoint_dir("llama")))
    assert_same_outputs(generate(llm, batch, PARAMS), expected)
    assert llm.engine.stats().spec_decode_num_drafts > 0
    assert_pool_balanced(llm)
    assert_draft_pool_empty(llm)


def test_draft_model_under_preemption_keeps_outputs(checkpoint_dir):
    # The budget is split between the two pools by their bytes per token: the target's share
    # holds 16 pages, far fewer than 6 requests need at once.
    config = draft_config(checkpoint_dir("qwen3"))
    tight, preemptions = run_in_a_tight_pool(str(checkpoint_dir("qwen3")), config, 32.5)
    assert tight.engine.parts.kv.num_pages == 16 and tight.engine.parts.draft.kv.num_pages >= 16
    assert preemptions, "the pool was meant to be too small for every request at once"
    assert tight.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_pool_balanced(tight)
    assert_draft_pool_empty(tight)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/dir"}, "/no/such/dir"),
    ],
)
def test_draft_model_config_errors(config, message, checkpoint_dir):
    with pytest.raises(Exception) as error:
        LLM(str(checkpoint_dir("qwen3")), device="cpu", speculative_config=config)
    assert message in str(error.value)


def test_a_hybrid_draft_model_is_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="must be attention-only"):
        LLM(str(checkpoint_dir("qwen3")), device="cpu", speculative_config=draft_config(checkpoint_dir("qwen3-next")))


# ---- the MTP head ----------------------------------------------------------------------------


MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoint_dir, tmp_path_factory):
    from tests.checkpoints import add_mtp_head

    return add_mtp_head(checkpoint_dir("qwen3-next"), tmp_path_factory.mktemp("qwen3-next-mtp"))


@pytest.fixture(scope="module")
def deepseek_mtp_checkpoint(checkpoint_dir, tmp_path_factory):
    from tests.checkpoints import add_deepseek_mtp_layer

    return add_deepseek_mtp_layer(checkpoint_dir("deepseek-v3"), tmp_path_factory.mktemp("deepseek-v3-mtp"))


def hf_layer_state(tensors: dict) -> dict:
    """A checkpoint layer's tensors as transformers' module holds them: experts stacked."""
    state = {k: v for k, v in tensors.items() if not k.startswith(("mlp.experts.", "mtp.", "model.", "lm_head"))}
    count = len({k.split(".")[2] for k in tensors if k.startswith("mlp.experts.")})
    expert = [{p: tensors[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")} for e in range(count)]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in expert])
    state["mlp.experts.down_proj"] = torch.stack([e["down"] for e in expert])
    return state


def reference_mtp_drafts(path, token_ids: list[int], num_drafts: int) -> list[int]:
    """The head's greedy drafts after `token_ids`, computed in one pass with transformers'
    own modules: the target's final hidden states, then rows (h[i], token[i + 1]) through
    the head's layer, then the chain, each row taking the head's output for the row before."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    config = AutoConfig.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(f"{path}/model.safetensors")
    layer = hf.Qwen3NextDecoderLayer(config, config.layer_types.index("full_attention")).eval()
    layer.load_state_dict(hf_layer_state({k.removeprefix("mtp.layers.0."): v for k, v in tensors.items()}))
    norms = {}
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        norms[name] = hf.Qwen3NextRMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].load_state_dict({"weight": tensors[f"mtp.{name}.weight"]})
    rotary = hf.Qwen3NextRotaryEmbedding(config)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    with torch.no_grad():
        hidden = target.model(torch.tensor([token_ids])).last_hidden_state[0, :-1]  # rows 0 .. L-2
        tokens = list(token_ids[1:])
        drafts = []
        for _ in range(num_drafts):
            ids = torch.tensor([tokens])
            mixed = torch.cat([norms["pre_fc_norm_embedding"](embed(ids)[0]), norms["pre_fc_norm_hidden"](hidden)], -1)
            rows = (mixed @ tensors["mtp.fc.weight"].T)[None]
            positions = torch.arange(rows.shape[1])[None]
            out = norms["norm"](layer(rows, rotary(rows, positions), position_ids=positions))[0]
            drafts.append(int(lm_head(out[-1]).argmax()))
            hidden, tokens = torch.cat([hidden, out[-1:]]), tokens + [drafts[-1]]
    return drafts


def reference_deepseek_mtp_drafts(path, token_ids: list[int], num_drafts: int) -> list[int]:
    """As `reference_mtp_drafts`, for DeepSeek-V3's layout: the MTP layer stored after the
    decoder's, with its own embeddings, plain RMS norms and LM head, built from transformers'
    DeepSeek-V3 decoder layer at that index (an MoE layer here, as in the releases)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"  # causal without a mask
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prefix = f"model.layers.{config.num_hidden_layers}."
    own = {k.removeprefix(prefix): v for k, v in load_file(f"{path}/model.safetensors").items() if k.startswith(prefix)}
    head_parts = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
    layer = hf.DeepseekV3DecoderLayer(config, config.num_hidden_layers).eval()
    layer.load_state_dict(hf_layer_state({k: v for k, v in own.items() if not k.startswith(head_parts)}))
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = hf.DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].load_state_dict({"weight": own[f"{name}.weight"]})
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    with torch.no_grad():
        hidden = target.model(torch.tensor([token_ids])).last_hidden_state[0, :-1]  # rows 0 .. L-2
        tokens = list(token_ids[1:])
        drafts = []
        for _ in range(num_drafts):
            embedded = own["embed_tokens.weight"][torch.tensor(tokens)]
            mixed = torch.cat([norms["enorm"](embedded), norms["hnorm"](hidden)], -1)
            rows = (mixed @ own["eh_proj.weight"].T)[None]
            positions = torch.arange(rows.shape[1])[None]
            out = layer(rows, position_embeddings=rotary(rows, positions), position_ids=positions)
            out = norms["shared_head.norm"](out)[0]
            drafts.append(int((out[-1] @ own["shared_head.head.weight"].T).argmax()))
            hidden, tokens = torch.cat([hidden, out[-1:]]), tokens + [drafts[-1]]
    return drafts


@pytest.mark.parametrize(
    "checkpoint, reference",
    [("mtp_checkpoint", reference_mtp_drafts), ("deepseek_mtp_checkpoint", reference_deepseek_mtp_drafts)],
    ids=["qwen3-next", "deepseek-v3"],
)
def test_mtp_head_drafts_what_transformers_modules_compute(checkpoint, reference, request):
    """Every draft the head proposes, over prompts fed in parts, verify outcomes and chains,
    equals a one-pass reference built from transformers' modules of the family."""
    mtp_checkpoint = request.getfixturevalue(checkpoint)
    llm = LLM(str(mtp_checkpoint), device="cpu", max_num_batched_tokens=24, page_size=8, speculative_config=MTP)
    proposals = []
    proposer = llm.engine.speculation.proposer
    original = proposer.propose

    def recording(asks):
        drafts = original(asks)
        proposals.extend((list(a.token_ids), d) for a, d in zip(asks, drafts) if d)
        return drafts

    proposer.propose = recording
    batch = looping_prompts(3)
    expected = generate(LLM(str(mtp_checkpoint), device="cpu"), batch, PARAMS[:3])
    assert_same_outputs(generate(llm, batch, PARAMS[:3]), expected)
    assert len(proposals) > 10
    for token_ids, drafts in proposals[::3]:
        assert list(drafts) == reference(mtp_checkpoint, token_ids, len(drafts)), token_ids
    assert_pool_balanced(llm)
    assert_draft_pool_empty(llm)


def test_mtp_is_refused_for_a_model_without_a_head(checkpoint_dir):
    with pytest.raises(ValueError, match="mtp_num_hidden_layers or num_nextn_predict_layers"):
        LLM(str(checkpoint_dir("qwen3-next")), device="cpu", speculative_config=MTP)
    # transformers' DeepSeek-V3 config declares one MTP layer by default; this checkpoint has none.
    with pytest.raises(ValueError, match=r"missing from the checkpoint: model\.layers\.3\.input_layernorm"):
        LLM(str(checkpoint_dir("deepseek-v3")), device="cpu", speculative_config=MTP)
    with pytest.raises(ValueError, match="'mtp' method runs the MTP layers"):
        LLM(str(checkpoint_dir("deepseek-v2")), device="cpu", speculative_config=MTP)
    with pytest.raises(ValueError, match="'mtp' method runs the MTP layers"):
        LLM(str(checkpoint_dir("qwen3")), device="cpu", speculative_config=MTP)


@pytest.mark.parametrize("checkpoint", ["mtp_checkpoint", "deepseek_mtp_checkpoint"])
def test_mtp_under_preemption_keeps_outputs_and_frees_everything(checkpoint, request):
    tight, preemptions = run_in_a_tight_pool(str(request.getfixturevalue(checkpoint)), MTP, 18)
    assert preemptions and tight.engine.stats().spec_decode_num_drafts > 0
    assert tight.engine.parts.kv.prefix_cache is None  # turned off for the head, with a warning
    assert_pool_balanced(tight)
    assert_draft_pool_empty(tight)
    assert not tight.engine.speculation.proposer._pending


def test_requests_whose_drafts_come_to_nothing_pause_and_let_steps_overlap(checkpoint_dir):
    """Drafting needs the last token on the host; a request whose drafts keep failing pauses,
    so the engine plans the next step while the last one runs, and outputs stay the same."""
    path = str(checkpoint_dir("qwen3"))
    torch.manual_seed(11)
    batch = [{"prompt_token_ids": torch.randperm(400)[:30].tolist()} for _ in range(2)]  # nothing repeats
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    expected = generate(LLM(path, device="cpu"), batch, params)
    llm = LLM(path, device="cpu", speculative_config=NGRAM)
    engine, overlapped = llm.engine, []
    launch = engine.parts.executor.launch
    engine.parts.executor.launch = lambda *a: (overlapped.append(engine._in_flight is not None), launch(*a))[1]
    assert_same_outputs(generate(llm, batch, params), expected)
    assert sum(overlapped) > 10, "paused requests were meant to let steps overlap"
    assert not engine.speculation._pauses  # forgotten with the finished requests
