"""The prefix cache: full KV pages indexed by the tokens they hold, as a tree of pages.

A path from the root spells a token prefix, one full page per edge (a radix tree whose edges
are exactly one page long, so no edge ever needs splitting). Pure Python; the page
allocator owns the pages and consults the tree for eviction.
"""

from __future__ import annotations

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
            child.last_used = self._clock
            node = child

    def evict(self, evictable: Callable[[int], bool]) -> int | None:
        """Drop the least recently used leaf whose page `evictable` allows; return its page."""
        leaves = [n for n in self._by_page.values() if not n.children and evictable(n.page)]
        if not leaves:
            return None
        victim = min(leaves, key=lambda n: n.last_used)
        del victim.parent.children[victim.key]
        del self._by_page[victim.page]
        return victim.page
