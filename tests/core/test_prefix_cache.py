"""The prefix tree and page accounting with sharing, without a model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.core.prefix_cache import PrefixCache
from kestrel.core.state import OutOfPagesError, PageAllocator

PAGE = 4


def test_match_returns_the_longest_cached_prefix_of_full_pages():
    cache = PrefixCache(PAGE)
    cache.insert(list(range(10)), [7, 8, 9])  # the third page is partial: not recorded
    assert len(cache) == 2
    assert cache.match(list(range(12))) == [7, 8]
    assert cache.match([0, 1, 2, 3, 99, 5, 6, 7]) == [7]  # diverges inside the second page
    assert cache.match([1, 2, 3, 4]) == []


def test_insert_keeps_the_existing_page_for_the_same_tokens():
    cache = PrefixCache(PAGE)
    cache.insert(list(range(8)), [1, 2])
    cache.insert(list(range(8)) + [50, 51, 52, 53], [5, 6, 7])  # same first two pages, one more
    assert cache.match(list(range(8)) + [50, 51, 52, 53]) == [1, 2, 7]
    assert 5 not in cache and 6 not in cache


def test_eviction_takes_least_recently_used_leaves_first():
    cache = PrefixCache(PAGE)
    cache.insert([0] * 8, [1, 2])  # 1 -> 2
    cache.insert([9] * 4, [3])
    cache.match([0] * 8)  # 1 and 2 are now more recent than 3
    assert cache.evict(lambda page: True) == [3]
    assert cache.evict(lambda page: page not in (1, 2)) == []  # 2 is in use, and so is 1 above it
    assert cache.evict(lambda page: True) == []  # a refused page waits to be offered again
    cache.offer(2)  # its last user let go
    assert cache.evict(lambda page: True) == [2]
    assert cache.evict(lambda page: True) == [1]


def test_an_unused_page_above_a_used_one_goes_with_everything_below_it():
    """A request that computed its own copy of a cached page caches its later pages below
    the cached copy: that copy can never become a leaf while the request runs."""
    cache = PrefixCache(PAGE)
    cache.insert([0] * 4, [1])
    cache.insert([0] * 4 + [5] * 8, [9, 2, 3])  # its own copy of page 1 (9) is not recorded
    assert cache.match([0] * 4 + [5] * 8) == [1, 2, 3]
    held = {2}  # the request holds 2 (and 9, 3 went back unused)
    assert cache.evict(lambda page: page not in held) == [3]  # a leaf first
    assert cache.evict(lambda page: page not in held) == [1]  # then 1, with 2 below it uncached
    assert len(cache) == 0


def test_cached_pages_are_reused_and_evicted_only_when_unreferenced():
    allocator = PageAllocator(num_pages=4, page_size=PAGE, prefix_cache=PrefixCache(PAGE))
    tokens = list(range(8))
    pages = allocator.reserve("a", 8)
    allocator.prefix_cache.insert(tokens, pages)
    allocator.release("a")
    assert (allocator.num_free_pages, allocator.num_cached_pages, allocator.num_used_pages) == (2, 2, 0)
    allocator.share("b", allocator.prefix_cache.match(tokens))
    assert allocator.num_used_pages == 2 and allocator.num_cached_pages == 0
    allocator.reserve("c", 8)  # takes the two free pages
    try:
        allocator.reserve("d", 4)
        raise AssertionError("pages held by b must not be evicted")
    except OutOfPagesError:
        pass
    allocator.release("b")
    assert allocator.reserve("d", 4)  # now an unreferenced cached page is evicted for d


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.integers(1, 6), st.integers(0, 2), st.booleans(), st.integers(0, 6)),
        max_size=50,
    )
)
def test_free_cached_and_used_always_add_up(operations):
    """Also where a request shares only part of its cached prefix (a hybrid model's, up to
    a snapshot): a page available by the count can always be had."""
    cache = PrefixCache(PAGE)
    allocator = PageAllocator(num_pages=12, page_size=PAGE, prefix_cache=cache)
    for request_id, length_pages, prefix_kind, release, share_at_most in operations:
        tokens = [prefix_kind] * (length_pages * PAGE)  # few distinct prefixes, so they are shared
        if release:
            cache.insert(tokens, allocator.pages_of(request_id))
            allocator.release(request_id)
        elif not allocator.pages_of(request_id):
            shared = cache.match(tokens)[: min(length_pages - 1, share_at_most)]
            allocator.share(request_id, shared)
            try:
                allocator.reserve(request_id, len(tokens))
            except OutOfPagesError:
                allocator.release(request_id)
        total = allocator.num_free_pages + allocator.num_cached_pages + allocator.num_used_pages
        assert total == allocator.num_pages and allocator.num_cached_pages >= 0
        held = {p for r in "abcd" for p in allocator.pages_of(r)}
        assert not held & set(allocator._free)  # a page in use is never also free
        assert allocator.num_used_pages == len(held)  # the running count matches the pages held


def test_eviction_order_matches_a_full_scan_under_random_use():
    """The candidate heap picks the same page a scan of every cached leaf would."""
    rng = random.Random(0)
    cache = PrefixCache(PAGE)
    allocator = PageAllocator(num_pages=64, page_size=PAGE, prefix_cache=cache)
    checked = 0
    prompts = [[rng.randrange(3) for _ in range(PAGE * rng.randint(1, 5))] for _ in range(40)]
    for step, tokens in enumerate(prompts):
        request_id = f"r{step}"
        shared = cache.match(tokens)[: len(tokens) // PAGE - 1]
        allocator.share(request_id, shared)
        leaves = [n for n in cache._by_page.values() if not n.children and allocator._refs[n.page] == 0]
        expected = min(leaves, key=lambda n: n.last_used).page if leaves and not allocator._free else None
        pages = allocator.reserve(request_id, len(tokens))
        if expected is not None:
            assert expected in pages and expected not in cache
            checked += 1
        cache.insert(tokens, pages)
        if rng.random() < 0.7:
            allocator.release(request_id)
    assert checked >= 5  # the pool ran dry often enough for evictions to be compared
