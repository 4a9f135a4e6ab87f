"""The host KV tier: pages the device prefix cache evicts, kept in host memory.

The device pool's prefix cache lets its least recently used pages go when it needs room.
With a host tier, each such page is first copied into a host page, named by the digest of
the prefix it ends (`prefix_cache.page_digest`); a later prompt whose prefix runs past what
the device still caches finds the following pages here, and they are copied back into
fresh device pages instead of being computed again (SGLang's HiCache and vLLM's offloading
connector keep prefixes the same way).

The tier holds a fixed number of pages (the size the user gives), least recently used
first out. A page handed out by `hold` is pinned until `release`, so that a store made
while the pages it was held for are still being copied in never overwrites them.

Ownership: the tier owns its host pages and index. The device pool (`PagedKVProvider`)
owns the copies: it calls `store` with a device page's contents and `pages` for the host
pages to copy back. Copies are queued on the device's current stream, in order with the
steps that read and write the same pages, so nothing waits for them on the host.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class HostTierCounters:
    """What the tier did since it started (reported by the engine's stats and /metrics)."""

    stored_pages: int = 0  # pages copied out of the device pool
    loaded_pages: int = 0  # pages copied back in, instead of computed again
    dropped_pages: int = 0  # pages the tier itself let go to make room


class HostKVTier:
    """A host store of fixed-size entries, each one tensor per part of `layout` (a KV page:
    one tensor; a recurrent state snapshot: its convolution and recurrent tensors)."""

    def __init__(self, layout: Sequence[tuple[Sequence[int], torch.dtype]], num_pages: int, pin_memory: bool) -> None:
        if num_pages < 1:
            raise ValueError(f"the host KV tier needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.parts = [torch.empty((num_pages, *shape), dtype=dtype, pin_memory=pin_memory) for shape, dtype in layout]
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # digest -> host page, oldest use first
        self._free = list(range(num_pages - 1, -1, -1))
        self._pins: Counter[int] = Counter()
        self.counters = HostTierCounters()
        self.snapshots: HostKVTier | None = None  # hybrid models: the recurrent state at some pages

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def bytes_per_page(self) -> int:
        return sum(part[0].numel() * part.element_size() for part in self.parts)

    def store(self, digest: bytes, *contents: torch.Tensor) -> None:
        """Keep a copy of a device entry's `contents` (one tensor per part) under its prefix's
        digest. Where no page is free and every page is pinned, it is not kept (it is
        computed again when asked for)."""
        if digest in self._pages:
            self._pages.move_to_end(digest)  # the same prefix has the same state
            return
        page = self._free.pop() if self._free else self._drop_oldest()
        if page is None:
            return
        for part, content in zip(self.parts, contents, strict=True):
            part[page].copy_(content, non_blocking=True)
        self._pages[digest] = page
        self.counters.stored_pages += 1

    def _drop_oldest(self) -> int | None:
        for digest, page in self._pages.items():
            if not self._pins[page]:
                del self._pages[digest]
                self.counters.dropped_pages += 1
                return page
        return None

    def count_held(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, the tier holds."""
        for count, digest in enumerate(digests):
            if digest not in self._pages:
                return count
        return len(digests)

    def hold(self, digests: Sequence[bytes]) -> list[int]:
        """The host pages of the leading `digests` the tier holds, pinned until `release`,
        and marked as just used."""
        pages = []
        for digest in digests[: self.count_held(digests)]:
            self._pages.move_to_end(digest)
            page = self._pages[digest]
            self._pins[page] += 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._pins[page] -= 1
            if not self._pins[page]:
                del self._pins[page]

    def page(self, page: int) -> list[torch.Tensor]:
        """A held entry's contents, one tensor per part, to copy into the device."""
        self.counters.loaded_pages += 1
        return [part[page] for part in self.parts]
