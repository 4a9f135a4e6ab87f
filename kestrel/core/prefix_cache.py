"""The prefix cache: full KV pages indexed by the tokens they hold, as a tree of pages.

A path from the root spells a token prefix, one full page per edge (a radix tree whose edges
are exactly one page long, so no edge ever needs splitting). Pure Python; the page
allocator owns the pages and consults the tree for eviction.

Eviction is least recently used among leaves, found through a heap of candidates rather than
a scan: with tens of thousands of cached pages, a scan per new page cost milliseconds per
decode step. The heap is lazy: an entry whose node was touched since it was pushed goes back
with its new time when popped; an entry whose page the allocator still uses is dropped, and
the allocator offers the page again (`offer`) once no request holds it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    page: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._root = _Node(page=-1, parent=None, key=())
        self._by_page: dict[int, _Node] = {}
        self._clock = 0
        self._candidates: list[tuple[int, int]] = []  # heap of (last_used when pushed, page)

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
                child = _Node(page=page, parent=node, key=key)
                node.children[key] = child
                self._by_page[page] = child
                heapq.heappush(self._candidates, (self._clock, page))
            child.last_used = self._clock
            node = child

    def offer(self, page: int) -> None:
        """Make a cached page an eviction candidate again: no request holds it any more."""
        node = self._by_page.get(page)
        if node is not None:
            heapq.heappush(self._candidates, (node.last_used, page))
            self._compact_if_bloated()

    def evict(self, evictable: Callable[[int], bool]) -> int | None:
        """Drop the least recently used leaf whose page `evictable` allows; return its page.

        Candidates that `evictable` refuses leave the heap until they are offered again.
        """
        while self._candidates:
            pushed_at, page = heapq.heappop(self._candidates)
            node = self._by_page.get(page)
            if node is None or node.children or not evictable(page):
                continue  # gone, an inner node (it is pushed again when it becomes a leaf), or in use
            if node.last_used != pushed_at:
                heapq.heappush(self._candidates, (node.last_used, page))  # touched since: requeue
                continue
            self._remove(node)
            return page
        return None

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.key]
        del self._by_page[node.page]
        if parent is not self._root and not parent.children:
            heapq.heappush(self._candidates, (parent.last_used, parent.page))

    def _compact_if_bloated(self) -> None:
        # Offers of shared pages can push one page many times; rebuild from the leaves when
        # stale entries outnumber live pages.
        if len(self._candidates) > 4 * len(self._by_page) + 1024:
            self._candidates = [(n.last_used, p) for p, n in self._by_page.items() if not n.children]
            heapq.heapify(self._candidates)
