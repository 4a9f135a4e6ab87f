"""Prefix caching changes nothing but speed: outputs with it equal outputs without it."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


def random_tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# A latent (MLA) pool stores keys alone: its cached pages must serve as values too.
@pytest.fixture(scope="module", params=["llama", "deepseek-v3"])
def engines(checkpoint_dir, request):
    path = str(checkpoint_dir(request.param))
    common = dict(page_size=8, max_num_batched_tokens=64)
    return LLM(path, enable_prefix_caching=True, **common), LLM(path, enable_prefix_caching=False, **common)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [list(lp.items()) for lp in o.outputs[0].logprobs]) for o in outputs]


def assert_same(actual, expected) -> None:
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(actual, expected):
        assert tokens == expected_tokens
        for position, expected_position in zip(logprobs, expected_logprobs):
            for (token, value), (expected_token, expected_value) in zip(position, expected_position):
                assert token == expected_token and value.logprob == pytest.approx(expected_value.logprob, abs=1e-4)


def test_shared_prefixes_partial_pages_and_whole_prompts(engines):
    cached, plain = engines
    system = random_tokens(45, seed=1)  # five full pages and a partial one
    questions = [system + random_tokens(n, seed=10 + n) for n in (1, 7, 20)]
    prompts = [system] + questions + [system[:40], system[:40]]  # a prompt of whole cached pages, twice
    before = cached.engine.stats()
    first = run(cached, prompts)
    second = run(cached, prompts)  # everything cached by now
    after = cached.engine.stats()
    expected = run(plain, prompts)
    assert_same(first, expected)
    assert_same(second, expected)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 40 * len(prompts)  # the second round reused at least the first five pages of each
    assert after.num_used_pages == 0
    assert after.num_free_pages + after.num_cached_pages + after.num_used_pages == after.num_total_pages


def test_prompt_logprobs_on_a_cached_prompt(engines):
    cached, plain = engines
    prompt = random_tokens(30, seed=2)
    run(cached, [prompt])  # now in the cache
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    with_cache = cached.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].prompt_logprobs
    without = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].prompt_logprobs
    assert len(with_cache) == len(without) == 30 and with_cache[0] is None
    for a, b in zip(with_cache[1:], without[1:]):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_memory_pressure_with_preemption_and_sharing(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    system = random_tokens(32, seed=3)
    prompts = [system + random_tokens(8, seed=20 + i) for i in range(8)]
    ample = LLM(path, page_size=8, enable_prefix_caching=False)
    expected = run(ample, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
    spec = ample.engine.parts.kv.spec
    tight = LLM(path, page_size=8, max_model_len=128, kv_cache_memory_gb=16 * spec.bytes_per_page() / 2**30)
    preempted = []
    original = tight.engine._apply
    tight.engine._apply = lambda plan: (preempted.extend(plan.preempted), original(plan))[1]
    got = run(tight, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
    assert preempted, "the pool was meant to be too small for every request at once"
    assert_same(got, expected)
    stats = tight.engine.stats()
    assert stats.num_used_pages == 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_hybrid_snapshots_under_pressure_change_nothing_but_speed(checkpoint_dir, family):
    """One snapshot to go round, a KV pool that must evict, conversations that continue:
    the same outputs as without caching, hits where a kept state allows, and every snapshot
    accounted for at the end."""
    path = str(checkpoint_dir(family))
    common = dict(page_size=8, max_num_batched_tokens=64, state_snapshot_interval=16, max_model_len=256)
    cold = LLM(path, enable_prefix_caching=False, **common)
    pages = 40
    warm = LLM(
        path,
        num_state_snapshots=1,
        kv_cache_memory_gb=pages * cold.engine.parts.kv.spec.bytes_per_page() / 2**30,
        **common,
    )
    assert warm.engine.parts.kv.num_pages == pages
    system = random_tokens(40, seed=11)
    first = [system + random_tokens(n, seed=20 + n) for n in (3, 17, 30)]
    assert_same(run(warm, first), run(cold, first))
    # A second turn of each conversation: its first turn, its answer, a new message.
    answers = [tokens for tokens, _ in run(cold, first)]
    second = [p + a + random_tokens(5, seed=50 + i) for i, (p, a) in enumerate(zip(first, answers))]
    before = warm.engine.stats().prefix_cache_hits
    assert_same(run(warm, second), run(cold, second))
    assert warm.engine.stats().prefix_cache_hits - before >= 16  # at least one kept state was reused
    recurrent, cache = warm.engine.parts.recurrent, warm.engine.parts.kv.prefix_cache
    recurrent.reclaim_snapshots()
    assert recurrent.num_free_snapshots + cache.num_snapshots == recurrent.num_snapshots == 1
    stats = warm.engine.stats()
    assert stats.num_used_pages == stats.num_used_state_slots == 0


def test_hybrid_snapshots_by_default_take_a_bounded_share_of_the_kv_budget(checkpoint_dir, caplog):
    """One snapshot per request that may run at once, as far as an eighth of the KV budget
    holds them; none (and prefix caching off, said in the log) where not one fits; as many
    as asked where `num_state_snapshots` is given."""
    from kestrel.engine.composition import SNAPSHOT_SHARE_OF_KV

    path = str(checkpoint_dir("qwen3-next"))
    roomy = LLM(path, max_num_seqs=8, kv_cache_memory_gb=0.05)
    assert roomy.engine.parts.recurrent.num_snapshots == 8
    unit = roomy.engine.parts.recurrent.spec.bytes_per_slot()
    tight_gb = 3.5 * unit / SNAPSHOT_SHARE_OF_KV / 2**30  # room for three copies
    assert LLM(path, max_num_seqs=8, kv_cache_memory_gb=tight_gb).engine.parts.recurrent.num_snapshots == 3
    with caplog.at_level("WARNING", logger="kestrel"):
        none = LLM(path, max_num_seqs=8, kv_cache_memory_gb=0.5 * unit / SNAPSHOT_SHARE_OF_KV / 2**30)
    assert none.engine.parts.recurrent.num_snapshots == 0 and none.engine.parts.kv.prefix_cache is None
    assert "prefix caching is off for this model" in caplog.text
    asked = LLM(path, max_num_seqs=8, kv_cache_memory_gb=tight_gb, num_state_snapshots=5)
    assert asked.engine.parts.recurrent.num_snapshots == 5
