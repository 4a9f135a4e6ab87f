"""The prefix cache: full KV pages indexed by the tokens they hold, as a tree of pages.

A path from the root spells a token prefix, one full page per edge (a radix tree whose edges
are exactly one page long, so no edge ever needs splitting). Pure Python; the page
allocator owns the pages and consults the tree for eviction.

Eviction is least recently used among leaves, found through a heap of candidates rather than
a scan: with tens of thousands of cached pages, a scan per new page cost milliseconds per
decode step. The heap is lazy: an entry whose node was touched since it was pushed goes back
with its new time when popped; an entry whose page the allocator still uses is dropped, and
the allocator offers the page again (`offer`) once no request holds it.

A hybrid model's cached prefix is only usable with the recurrent state after it, so a node
may also hold a snapshot: the id of a copy of that state after the node's last token (the
recurrent provider owns the copies). `match_snapshot` finds the deepest node that holds one;
removing a node hands its snapshot to `on_snapshot_dropped`.

Each node also carries the digest of the whole prefix it ends (`page_digest`, chained from
the root): a name for its page's contents that outlives the node. An eviction that frees a
page hands its page and digest to `on_page_evicted` before the page is reused, which is how
a host tier (`core/host_tier.py`) keeps what the device pool lets go.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROOT_DIGEST = b""


def page_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a prefix: its last page's tokens chained onto the digest of the prefix
    before them. 128 bits, so two different prefixes never meet in practice (a collision
    would hand one prompt another's keys and values)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class _Node:
    page: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0
    depth: int = 0  # pages from the root: of two as recent, the deeper goes first
    snapshot: int | None = None  # the recurrent state after this node's tokens, if kept
    digest: bytes = ROOT_DIGEST  # of the whole prefix this node ends


class PrefixCache:
    def __init__(
        self,
        page_size: int,
        on_snapshot_dropped: Callable[[int], None] | None = None,
        on_page_evicted: Callable[[int, bytes], None] | None = None,
    ) -> None:
        self.page_size = page_size
        self.on_snapshot_dropped = on_snapshot_dropped
        self.on_page_evicted = on_page_evicted  # (page, digest of its prefix), before reuse
        # (snapshot, digest of its node's prefix) when a snapshot leaves its node, before reuse.
        self.on_snapshot_evicted: Callable[[int, bytes], None] | None = None
        self._root = _Node(page=-1, parent=None, key=())
        self._by_page: dict[int, _Node] = {}
        self._by_snapshot: dict[int, _Node] = {}
        self._clock = 0
        # heap of (last_used when pushed, -depth, page)
        self._candidates: list[tuple[int, int, int]] = []

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    def __len__(self) -> int:
        return len(self._by_page)

    def _keys(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        size = self.page_size
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens) - size + 1, size)]

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Pages holding the longest cached prefix of `tokens`, in order (full pages only)."""
        self._clock += 1
        node, pages, size = self._root, [], self.page_size
        # Keys are cut one page at a time: most lookups miss on an early page.
        for start in range(0, len(tokens) - size + 1, size):
            node = node.children.get(tuple(tokens[start : start + size]))
            if node is None:
                break
            node.last_used = self._clock
            pages.append(node.page)
        return pages

    def digest_of(self, page: int) -> bytes:
        """The digest of the prefix that the cached `page` ends."""
        return self._by_page[page].digest

    def snapshot_at(self, tokens: Sequence[int]) -> int | None:
        """The snapshot the node of `tokens` (whole pages) keeps, if any."""
        node = self._node_of(tokens)
        return node.snapshot if node is not None else None

    def match_snapshot(self, tokens: Sequence[int], max_pages: int) -> tuple[list[int], int | None]:
        """Pages of the longest cached prefix of `tokens` (at most `max_pages`) that ends at a
        node holding a snapshot, and that snapshot; ([], None) where none does."""
        pages = self.match(tokens)[:max_pages]
        depth, snapshot = 0, None
        for index, page in enumerate(pages, start=1):
            if self._by_page[page].snapshot is not None:
                depth, snapshot = index, self._by_page[page].snapshot
        return pages[:depth], snapshot

    def snapshot_wanted(self, tokens: Sequence[int]) -> bool:
        """Whether the node of `tokens` (whole pages) exists and holds no snapshot yet."""
        node = self._node_of(tokens)
        return node is not None and node.snapshot is None

    def attach_snapshot(self, tokens: Sequence[int], snapshot: int) -> None:
        """Keep `snapshot` (the state after `tokens`) on their node; `snapshot_wanted` first."""
        node = self._node_of(tokens)
        if node is None or node.snapshot is not None:
            raise ValueError("no node without a snapshot for these tokens")
        node.snapshot = snapshot
        self._by_snapshot[snapshot] = node

    def evict_snapshot(self, evictable: Callable[[int], bool]) -> int | None:
        """Take the least recently used snapshot whose page `evictable` allows off its node
        (the node's KV stays cached); return it, or None."""
        candidates = [node for node in self._by_snapshot.values() if evictable(node.page)]
        if not candidates:
            return None
        node = min(candidates, key=lambda n: n.last_used)
        snapshot, node.snapshot = node.snapshot, None
        del self._by_snapshot[snapshot]
        if self.on_snapshot_evicted is not None:
            self.on_snapshot_evicted(snapshot, node.digest)
        return snapshot

    @property
    def num_snapshots(self) -> int:
        return len(self._by_snapshot)

    def _node_of(self, tokens: Sequence[int]) -> _Node | None:
        node = self._root
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None:
                return None
        return None if node is self._root else node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Remember that `pages` hold the full pages of `tokens`. Where a page of the same
        tokens is cached already, the cached one stays and the new one is not recorded."""
        self._clock += 1
        node = self._root
        for key, page in zip(self._keys(tokens), pages):
            child = node.children.get(key)
            if child is None:
                if page in self._by_page:
                    return  # the page already spells another prefix: stop rather than alias it
                digest = page_digest(node.digest, key)
                child = _Node(page, node, key, last_used=self._clock, depth=node.depth + 1, digest=digest)
                node.children[key] = child
                self._by_page[page] = child
                self._push(child)
            child.last_used = self._clock
            node = child

    def offer(self, page: int) -> None:
        """Make a cached page an eviction candidate again: no request holds it any more."""
        node = self._by_page.get(page)
        if node is not None:
            self._push(node)
            self._compact_if_bloated()

    def evict(self, evictable: Callable[[int], bool]) -> list[int]:
        """Drop the least recently used node whose page `evictable` allows; return the pages
        that leave the cache and no request holds (free from now on), [] when none can go.

        A leaf goes alone. An inner node goes only while a request holds a page below it (a
        request that did not share that node's page computed its own copy of it, and cached
        pages of its own below): it could not become a leaf, so it goes with everything
        below it, and the held pages stay with their requests, uncached.
        Candidates that `evictable` refuses leave the heap until they are offered again.
        """
        while self._candidates:
            pushed_at, _, page = heapq.heappop(self._candidates)
            node = self._by_page.get(page)
            if node is None or not evictable(page):
                continue  # gone, or in use
            if node.last_used != pushed_at:
                self._push(node)  # touched since: requeue
                continue
            below = list(self._below(node))
            if below and all(evictable(n.page) for n in below):
                continue  # its leaves go first; it is pushed again when it becomes one
            freed = [n for n in (node, *below) if evictable(n.page)]
            self._remove(node, below, freed)
            if self.on_page_evicted is not None:
                for gone in freed:
                    self.on_page_evicted(gone.page, gone.digest)
            return [n.page for n in freed]
        return []

    def _below(self, node: _Node):
        for child in node.children.values():
            yield child
            yield from self._below(child)

    def _remove(self, node: _Node, below: list[_Node], freed: list[_Node]) -> None:
        """Take `node` and the nodes `below` it out of the tree. Only the snapshots of the
        `freed` nodes (pages no request holds) are handed to `on_snapshot_evicted`: a held
        page's snapshot may be the one a chunk of the step being planned saves to, its state
        not yet written."""
        parent = node.parent
        del parent.children[node.key]
        for gone in (node, *below):
            del self._by_page[gone.page]
            if gone.snapshot is not None:
                del self._by_snapshot[gone.snapshot]
                if self.on_snapshot_evicted is not None and gone in freed:
                    self.on_snapshot_evicted(gone.snapshot, gone.digest)
                if self.on_snapshot_dropped is not None:
                    self.on_snapshot_dropped(gone.snapshot)
        if parent is not self._root and not parent.children:
            self._push(parent)

    def _compact_if_bloated(self) -> None:
        # Offers of shared pages can push one page many times; rebuild from the leaves when
        # stale entries outnumber live pages.
        if len(self._candidates) > 4 * len(self._by_page) + 1024:
            self._candidates = [(n.last_used, -n.depth, p) for p, n in self._by_page.items() if not n.children]
            heapq.heapify(self._candidates)

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._candidates, (node.last_used, -node.depth, node.page))
