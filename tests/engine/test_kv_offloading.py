"""The host KV tier behind the prefix cache: prefixes the device pool evicted come back from
host memory, and change nothing but speed."""

from __future__ import annotations

import pytest

from kestrel import LLM, SamplingParams
from tests.engine.test_prefix_caching import assert_same, random_tokens, run

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def pool_gb(llm: LLM, pages: int) -> float:
    return pages * llm.engine.parts.kv.spec.bytes_per_page() / 2**30


@pytest.fixture(scope="module")
def plain(checkpoint_dir):
    return LLM(str(checkpoint_dir("llama")), page_size=8, enable_prefix_caching=False)


def conversations(num_systems: int, rounds: int) -> list[list[list[int]]]:
    """Rounds of one question after each of `num_systems` long system prompts: together more
    than the device pool holds, so each round finds the last round's prefixes evicted."""
    systems = [random_tokens(48, seed=100 + s) for s in range(num_systems)]
    return [[system + random_tokens(5, seed=1000 * r + s) for s, system in enumerate(systems)] for r in range(rounds)]


def test_evicted_prefixes_come_back_from_host_memory(checkpoint_dir, plain):
    path = str(checkpoint_dir("llama"))
    common = dict(page_size=8, max_model_len=128, max_num_batched_tokens=64)
    device_pages = 24  # about three requests' worth: four system prompts do not stay
    tiered = LLM(path, kv_cache_memory_gb=pool_gb(plain, device_pages), kv_offloading_size=pool_gb(plain, 64), **common)
    untiered = LLM(path, kv_cache_memory_gb=pool_gb(plain, device_pages), **common)
    rounds = conversations(num_systems=4, rounds=3)
    for prompts in rounds:
        expected = run(plain, prompts, PARAMS)
        assert_same(run(tiered, prompts, PARAMS), expected)
        assert_same(run(untiered, prompts, PARAMS), expected)
    with_tier, without = tiered.engine.stats(), untiered.engine.stats()
    # Rounds two and three: every system prompt's six full pages, from one tier or the other.
    assert with_tier.prefix_cache_hits >= 2 * 4 * 48
    assert with_tier.kv_offload_hit_tokens > 0
    assert with_tier.prefix_cache_hits > without.prefix_cache_hits + with_tier.kv_offload_hit_tokens // 2
    bytes_per_page = tiered.engine.parts.kv.spec.bytes_per_page()
    assert with_tier.kv_offload_loaded_bytes == with_tier.kv_offload_hit_tokens // 8 * bytes_per_page
    assert with_tier.kv_offload_stored_bytes >= with_tier.kv_offload_loaded_bytes
    assert with_tier.num_used_pages == 0
    assert with_tier.num_free_pages + with_tier.num_cached_pages == with_tier.num_total_pages


def test_a_host_tier_smaller_than_the_prefixes_still_gives_the_same_outputs(checkpoint_dir, plain):
    """Pages the tier drops, or drops between a lookup and the copy back, are computed again."""
    path = str(checkpoint_dir("llama"))
    common = dict(page_size=8, max_model_len=128, max_num_batched_tokens=32)
    tiny = LLM(path, kv_cache_memory_gb=pool_gb(plain, 16), kv_offloading_size=pool_gb(plain, 4), **common)
    for prompts in conversations(num_systems=3, rounds=2):
        assert_same(run(tiny, prompts, PARAMS), run(plain, prompts, PARAMS))
    assert tiny.engine.stats().num_used_pages == 0


def test_preemption_by_swap_beside_the_host_tier(checkpoint_dir, plain):
    path = str(checkpoint_dir("llama"))
    tight = LLM(
        path,
        page_size=8,
        max_model_len=112,
        kv_cache_memory_gb=pool_gb(plain, 16),
        kv_offloading_size=pool_gb(plain, 32),
        preemption_mode="swap",
    )
    prompts = [p for prompts in conversations(num_systems=2, rounds=3) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    assert_same(run(tight, prompts, params), run(plain, prompts, params))
    assert tight.engine.num_swapped_out > 0 and tight.engine.stats().num_used_pages == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv_offloading_size=0.0), "must be positive"),
        (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"), "'lmcache' is not supported"),
        (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "needs enable_prefix_caching"),
        (dict(kv_offloading_size=1.0, tensor_parallel_size=2), "tensor parallelism"),
    ],
)
def test_offloading_options_that_cannot_be_served_are_named(options, message):
    from kestrel.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", **options)


def test_a_snapshot_whose_state_is_still_being_computed_never_goes_to_host_memory():
    """`bench prefix`'s hybrid workload, smaller: requests of four 512-token system prompts at
    once, one device snapshot, a pool so small that admitting one request takes back nodes
    another still holds, among them the node a chunk of the same step saves its state to.
    That snapshot is dropped, not copied to the tier half-written (it was, and a later request
    of that system prompt started from another prompt's state)."""
    import argparse

    from kestrel.bench.prefix import run_once, workload

    args = argparse.Namespace(
        model="qwen3-next-tiny",
        load_format="dummy",
        kv_cache_memory_gb=0.0005,
        max_model_len=1024,
        output_len=16,
        num_prompts=8,
        num_systems=4,
        system_len=512,
        question_len=32,
        num_state_snapshots=1,
    )
    prompts = workload(args)
    _, expected = run_once(args, prompts, enable_prefix_caching=False)
    report, outputs = run_once(args, prompts, enable_prefix_caching=True, kv_offloading_size=0.5)
    assert outputs == expected
    assert report["kv_offload_hit_tokens"] > 0


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_a_hybrid_models_snapshots_come_back_from_host_memory_too(checkpoint_dir, family):
    """One device snapshot to go round and a pool that must evict: the prefixes' pages and the
    recurrent state after them go to host memory and come back, and nothing else changes."""
    path = str(checkpoint_dir(family))
    common = dict(page_size=8, max_model_len=96, max_num_batched_tokens=64, state_snapshot_interval=16)
    plain_hybrid = LLM(path, enable_prefix_caching=False, **common)
    tiered = LLM(
        path,
        num_state_snapshots=1,
        kv_cache_memory_gb=pool_gb(plain_hybrid, 12),
        kv_offloading_size=pool_gb(plain_hybrid, 64)
        + 64 * plain_hybrid.engine.parts.recurrent.spec.bytes_per_slot() / 2**30,
        **common,
    )
    assert tiered.engine.parts.kv.host_tier.snapshots is not None
    for prompts in conversations(num_systems=3, rounds=3):
        for prompt in prompts:  # one at a time: each takes the one device snapshot from the last
            assert_same(run(tiered, [prompt], PARAMS), run(plain_hybrid, [prompt], PARAMS))
    stats = tiered.engine.stats()
    assert stats.kv_offload_hit_tokens >= 16  # at least one prefix came back whole, state and all
    tier = tiered.engine.parts.kv.host_tier
    assert tier.snapshots.counters.loaded_pages > 0 and tier.counters.loaded_pages > 0
    assert stats.num_used_pages == 0 and stats.num_used_state_slots == 0
