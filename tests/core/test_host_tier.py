"""The host KV tier's bookkeeping, and the prefix cache's digests and eviction hook it relies on."""

from __future__ import annotations

import pytest
import torch

from kestrel.core.host_tier import HostKVTier
from kestrel.core.prefix_cache import ROOT_DIGEST, PrefixCache, page_digest
from kestrel.core.state import PageAllocator

PAGE = 4


def tier(num_pages: int) -> HostKVTier:
    return HostKVTier([((2, PAGE), torch.float32)], num_pages, pin_memory=False)


def page_of(value: float) -> torch.Tensor:
    return torch.full((2, PAGE), value)


def test_store_keeps_contents_and_drops_the_least_recently_used():
    host = tier(2)
    host.store(b"a", page_of(1.0))
    host.store(b"b", page_of(2.0))
    host.release(host.hold([b"a"]))  # a use: "b" is now the oldest
    host.store(b"c", page_of(3.0))
    assert b"b" not in host and b"a" in host and b"c" in host
    (page,) = host.hold([b"c"])
    assert torch.equal(host.page(page)[0], page_of(3.0))
    assert host.counters.stored_pages == 3 and host.counters.dropped_pages == 1 and host.counters.loaded_pages == 1


def test_a_held_page_is_never_overwritten():
    host = tier(1)
    host.store(b"a", page_of(1.0))
    held = host.hold([b"a"])
    host.store(b"b", page_of(2.0))  # no page to spare: "b" is not kept
    assert b"b" not in host and torch.equal(host.page(held[0])[0], page_of(1.0))
    host.release(held)
    host.store(b"b", page_of(2.0))
    assert b"b" in host and b"a" not in host


def test_hold_takes_the_leading_run_only():
    host = tier(4)
    for name in (b"a", b"b", b"d"):
        host.store(name, page_of(0.0))
    assert host.count_held([b"a", b"b", b"c", b"d"]) == 2
    assert len(host.hold([b"a", b"b", b"c", b"d"])) == 2
    assert host.hold([b"c", b"a"]) == []


def test_storing_a_prefix_again_copies_nothing():
    host = tier(2)
    host.store(b"a", page_of(1.0))
    host.store(b"a", page_of(9.0))  # the same prefix has the same keys and values
    assert host.counters.stored_pages == 1 and len(host) == 1


def test_node_digests_chain_from_the_root():
    cache = PrefixCache(PAGE)
    tokens = list(range(10, 22))
    cache.insert(tokens, [5, 6, 7])
    digest = ROOT_DIGEST
    for index, page in enumerate([5, 6, 7]):
        digest = page_digest(digest, tokens[index * PAGE : (index + 1) * PAGE])
        assert cache.digest_of(page) == digest
    assert page_digest(ROOT_DIGEST, [1, 2, 3, 4]) != page_digest(ROOT_DIGEST, [1, 2, 3, 5])
    # The same page of tokens after a different prefix is a different prefix.
    assert page_digest(page_digest(ROOT_DIGEST, [1] * 4), [2] * 4) != page_digest(ROOT_DIGEST, [2] * 4)


def test_eviction_reports_the_freed_pages_with_their_digests():
    evicted = []
    cache = PrefixCache(PAGE, on_page_evicted=lambda page, digest: evicted.append((page, digest)))
    allocator = PageAllocator(num_pages=3, page_size=PAGE, prefix_cache=cache)
    tokens = list(range(8))
    pages = allocator.reserve("a", 8)
    cache.insert(tokens, pages)
    digests = [cache.digest_of(p) for p in pages]
    allocator.release("a")  # both pages now cached, held by nobody
    allocator.reserve("b", 12)  # three pages: one free, two evicted (the leaf first)
    assert evicted == [(pages[1], digests[1]), (pages[0], digests[0])]


@pytest.mark.parametrize("num_pages", [0, -1])
def test_a_tier_without_pages_is_refused(num_pages):
    with pytest.raises(ValueError, match="at least one page"):
        tier(num_pages)
