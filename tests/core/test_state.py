"""Page accounting: free + used == total after every operation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.core.recurrent_state import RecurrentStateProvider, RecurrentStateSpec
from kestrel.core.state import KVCacheSpec, OutOfPagesError, PageAllocator, PagedKVProvider


def balanced(allocator: PageAllocator) -> bool:
    return allocator.num_free_pages + allocator.num_used_pages == allocator.num_pages


def test_reserve_grows_by_whole_pages_and_release_returns_them():
    allocator = PageAllocator(num_pages=8, page_size=4)
    assert allocator.reserve("a", 5) == [0, 1]
    assert allocator.reserve("a", 8) == [0, 1]
    assert allocator.reserve("a", 9) == [0, 1, 2]
    assert allocator.num_used_pages == 3 and balanced(allocator)
    allocator.release("a")
    assert allocator.num_free_pages == 8 and allocator.pages_of("a") == []


def test_over_reservation_is_refused_without_side_effects():
    allocator = PageAllocator(num_pages=2, page_size=4)
    allocator.reserve("a", 4)
    with pytest.raises(OutOfPagesError, match="needs 2 more KV pages but only 1 are free"):
        allocator.reserve("b", 8)
    assert allocator.pages_of("b") == [] and balanced(allocator)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 40), st.booleans()), max_size=60))
def test_accounting_balances_after_any_sequence_of_operations(operations):
    allocator = PageAllocator(num_pages=16, page_size=4)
    for request_id, tokens, release in operations:
        if release:
            allocator.release(request_id)
        else:
            with contextlib.suppress(OutOfPagesError):  # refusals must leave the books balanced too
                allocator.reserve(request_id, tokens)
        assert balanced(allocator)
        owned = [p for r in "abcd" for p in allocator.pages_of(r)]
        assert len(owned) == len(set(owned))  # no page has two owners


def test_provider_sizes_the_pool_from_the_byte_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
    assert spec.bytes_per_page() == 2 * 2 * 2 * 8 * 4 * 4
    provider = PagedKVProvider(spec, budget_bytes=10 * spec.bytes_per_page() + 7, device=torch.device("cpu"))
    assert provider.num_pages == 10 and provider.capacity_tokens == 40
    assert provider.layer(1).key.shape == (2, 11, 4, 8)  # head-major pages, plus the scratch page
    assert provider.scratch_id == 10
    with pytest.raises(ValueError, match="holds no page"):
        PagedKVProvider(spec, budget_bytes=10, device=torch.device("cpu"))


def test_a_latent_pool_stores_keys_alone_and_reads_values_from_them():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=12, dtype=torch.float32, page_size=4, latent_dim=8)
    assert spec.bytes_per_page() == 1 * 2 * 1 * 12 * 4 * 4  # no value pages
    provider = PagedKVProvider(spec, budget_bytes=3 * spec.bytes_per_page(), device=torch.device("cpu"))
    assert provider.num_pages == 3
    layer = provider.layer(1)
    assert layer.values_in_keys and layer.key.shape == (1, 4, 4, 12) and layer.value.shape == (1, 4, 4, 8)
    from kestrel.core.attention.torch_ref import store_kv

    key = torch.randn(5, 1, 12)
    store_kv(layer, key, key[..., :8], torch.tensor([0, 1, 2, 3, 4]))
    assert torch.equal(layer.value[0, :2].reshape(8, 8)[:5], key[:, 0, :8])
    assert torch.equal(provider.layer(0).key, torch.zeros_like(provider.layer(0).key))  # layers apart


# ---- the StateProvider contract, for every provider ---------------------------------------


def kv_provider(units: int) -> PagedKVProvider:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=4)
    return PagedKVProvider(spec, units * spec.bytes_per_page(), torch.device("cpu"))


def recurrent_provider(units: int) -> RecurrentStateProvider:
    spec = RecurrentStateSpec(
        num_layers=2, conv_channels=6, conv_width=3, num_heads=2, key_dim=4, value_dim=4, conv_dtype=torch.float32
    )
    return RecurrentStateProvider(spec, units, torch.device("cpu"))


PROVIDERS = [kv_provider, recurrent_provider]


@pytest.mark.parametrize("make", PROVIDERS)
def test_provider_reserves_for_a_request_and_release_gives_everything_back(make):
    provider = make(6)
    assert provider.free_capacity() == provider.total_capacity() == 6
    first = provider.reserve("a", 3)
    assert first and provider.held_by("a") == first
    grown = provider.reserve("a", 8)
    assert grown[: len(first)] == first  # growing never moves what is held
    assert provider.free_capacity() == 6 - len(grown)
    provider.release("a")
    provider.release("a")  # a second release, like one of an unknown request, does nothing
    assert provider.held_by("a") == [] and provider.free_capacity() == 6


@pytest.mark.parametrize("make", PROVIDERS)
def test_provider_refuses_what_it_cannot_hold_without_side_effects(make):
    provider = make(1)
    provider.reserve("a", 4)
    with pytest.raises(OutOfPagesError):
        provider.reserve("b", 4)
    assert provider.held_by("b") == [] and provider.free_capacity() == 0


@pytest.mark.parametrize("make", PROVIDERS)
@settings(max_examples=100, deadline=None)
@given(operations=st.lists(st.tuples(st.sampled_from("abcd"), st.integers(1, 24), st.booleans()), max_size=40))
def test_provider_accounting_balances_after_any_operations(make, operations):
    provider = make(8)
    for request_id, tokens, release in operations:
        if release:
            provider.release(request_id)
        else:
            with contextlib.suppress(OutOfPagesError):
                provider.reserve(request_id, tokens)
        held = [unit for r in "abcd" for unit in provider.held_by(r)]
        assert len(held) == len(set(held))  # no unit has two owners
        assert provider.free_capacity() + len(held) == provider.total_capacity()


def test_recurrent_slots_are_sized_by_layer_and_leave_a_scratch_slot():
    provider = recurrent_provider(3)
    layer = provider.layer(1)
    assert layer.conv.shape == (4, 6, 3) and layer.recurrent.shape == (4, 2, 4, 4)
    assert layer.recurrent.dtype == torch.float32 and provider.scratch_id == 3
    assert provider.spec.bytes_per_slot() == 2 * (6 * 3 * 4 + 2 * 4 * 4 * 4)
