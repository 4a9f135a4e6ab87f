"""Page accounting: free + used == total after every operation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert provider.scratch_page == 10
    with pytest.raises(ValueError, match="holds no page"):
        PagedKVProvider(spec, budget_bytes=10, device=torch.device("cpu"))
