"""Per-request state memory: specs that layers declare, and the paged KV provider.

Ownership: the `PagedKVProvider` owns every page. A request owns the pages reserved for it
from `reserve` until `release`; nobody else frees them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kestrel.core.prefix_cache import PrefixCache

# The float8 dtypes a KV pool may store (with a backend that declares it can read them).
FLOAT8_KV_DTYPES = frozenset({torch.float8_e4m3fn})


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV state one stack of full-attention layers needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    def bytes_per_page(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
        return per_token * self.page_size

    def pages_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_page()


class OutOfPagesError(RuntimeError):
    """Raised when a reservation asks for more pages than are free; the planner should prevent it."""


class PageAllocator:
    """Pure-Python page accounting: which requests hold which pages. No tensors.

    A page is free, in use (held by one or more requests: prefix pages are shared, counted
    by reference), or cached: held by no request but kept in the prefix cache until the
    pool needs room. free + cached + in use == total, always.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        # Pop from the end, so low page ids are handed out first (easier to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._num_used = 0  # pages with refs > 0, kept as a count: the planner asks every step
        self._owned: dict[str, list[int]] = {}

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take_free_page(self) -> int:
        if not self._free and self.prefix_cache is not None:
            page = self.prefix_cache.evict(lambda p: self._refs[p] == 0)
            if page is not None:
                return page
        return self._free.pop()

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's pages so they hold `num_tokens` tokens; return all its pages."""
        pages = self._owned.setdefault(request_id, [])
        missing = self.pages_needed(num_tokens) - len(pages)
        if missing <= 0:  # most decode steps: the last page still has room
            return pages
        if missing > self.num_available_pages:
            raise OutOfPagesError(
                f"request {request_id} needs {missing} more KV pages but only {self.num_available_pages} are free"
            )
        for _ in range(missing):
            page = self._take_free_page()
            self._refs[page] = 1
            self._num_used += 1
            pages.append(page)
        return pages

    def share(self, request_id: str, pages: list[int]) -> None:
        """Give a request that holds nothing yet the cached pages of its prefix."""
        if self._owned.get(request_id):
            raise ValueError(f"request {request_id} already holds pages; share only at admission")
        for page in pages:
            self._num_used += self._refs[page] == 0
            self._refs[page] += 1
        self._owned[request_id] = list(pages)

    def release(self, request_id: str) -> None:
        for page in reversed(self._owned.pop(request_id, [])):
            self._refs[page] -= 1
            self._num_used -= self._refs[page] == 0
            if self._refs[page] > 0:
                continue
            if self.prefix_cache is not None and page in self.prefix_cache:
                self.prefix_cache.offer(page)  # unused but cached: evictable from now on
            else:
                self._free.append(page)

    def pages_of(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        """Pages kept only by the prefix cache: reusable, and evictable when room is needed."""
        return self.num_pages - self.num_free_pages - self.num_used_pages

    @property
    def num_available_pages(self) -> int:
        return self.num_free_pages + self.num_cached_pages

    @property
    def num_used_pages(self) -> int:
        return self._num_used


class StateProvider(ABC):
    """Owns one kind of per-request state memory and hands it to requests."""

    @abstractmethod
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Make room for `num_tokens` tokens of the request; return its page (or slot) ids."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Give back everything the request holds; a no-op for unknown requests."""

    @abstractmethod
    def free_capacity(self) -> int:
        """Free units (pages or slots) left in the pool."""

    @abstractmethod
    def total_capacity(self) -> int:
        """Units in the pool; free + held by requests (+ cached, for KV pages) == total."""

    @abstractmethod
    def held_by(self, request_id: str) -> list[int]:
        """The units the request holds now; empty for unknown requests."""


@dataclass(frozen=True)
class KVLayerCache:
    """The key and value pages of one layer: each [num_kv_heads, num_pages, page_size, head_dim].

    Head-major, so gathering a sequence's pages yields one contiguous [tokens, head_dim]
    block per head: the layout attention kernels read fastest. A float8 pool stores each
    page's values slot-minor ([head_dim, page_size] in memory; `value` is a strided view,
    `values_by_slot`): a kernel then reads them as the second dot needs them, along the
    keys, in whole vectors rather than byte by byte.
    """

    key: torch.Tensor
    value: torch.Tensor

    @property
    def values_by_slot(self) -> bool:
        return self.value.stride(-1) != 1


class PagedKVProvider(StateProvider):
    """The paged KV pool for every full-attention layer, sized from an explicit byte budget."""

    def __init__(
        self, spec: KVCacheSpec, budget_bytes: int, device: torch.device, enable_prefix_caching: bool = False
    ) -> None:
        num_pages = spec.pages_for_budget(budget_bytes)
        if num_pages < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes} bytes holds no page of "
                f"{spec.bytes_per_page()} bytes; raise kv_cache_memory_gb"
            )
        self.spec = spec
        cache = PrefixCache(spec.page_size) if enable_prefix_caching else None
        self.allocator = PageAllocator(num_pages, spec.page_size, cache)
        # One page past the allocator's range that no request ever owns: padded rows of a
        # captured graph write their throwaway keys and values there.
        self.scratch_page = num_pages
        shape = (spec.num_layers, 2, spec.num_kv_heads, num_pages + 1, spec.page_size, spec.head_dim)
        # Zeros, not empty: masked-out positions are multiplied by zero weights, and
        # uninitialised memory may hold NaN, which would survive that multiplication.
        self._storage = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._layers = tuple(
            KVLayerCache(key=layer[0], value=self._values(layer[1])) for layer in self._storage.unbind(0)
        )

    def _values(self, pages: torch.Tensor) -> torch.Tensor:
        """One layer's value pages, as KVLayerCache describes them."""
        if self.spec.dtype not in FLOAT8_KV_DTYPES:
            return pages
        heads, num_pages, page_size, head_dim = pages.shape
        return pages.view(heads, num_pages, head_dim, page_size).transpose(2, 3)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.spec.page_size

    def layer(self, index: int) -> KVLayerCache:
        return self._layers[index]

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        return self.allocator.reserve(request_id, num_tokens)

    def release(self, request_id: str) -> None:
        self.allocator.release(request_id)

    def free_capacity(self) -> int:
        return self.allocator.num_available_pages

    def total_capacity(self) -> int:
        return self.allocator.num_pages

    def held_by(self, request_id: str) -> list[int]:
        return list(self.allocator.pages_of(request_id))

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.allocator.prefix_cache

    def share(self, request_id: str, pages: list[int]) -> None:
        self.allocator.share(request_id, pages)

    def cache_prefix(self, request_id: str, token_ids: list[int]) -> None:
        """Record the request's full pages of `token_ids` (whose KV is computed) for reuse."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(token_ids, self.allocator.pages_of(request_id))


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The fixed-size state one stack of linear-attention (gated DeltaNet) layers keeps per
    request: the last inputs of the causal convolution and the recurrent matrix per head."""

    num_layers: int
    conv_channels: int
    conv_width: int  # inputs kept: the kernel size minus one
    num_heads: int
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    state_dtype: torch.dtype = torch.float32  # the recurrence accumulates: kept in float32

    def bytes_per_slot(self) -> int:
        conv = self.conv_channels * self.conv_width * torch.empty((), dtype=self.conv_dtype).element_size()
        state = self.num_heads * self.key_dim * self.value_dim * torch.empty((), dtype=self.state_dtype).element_size()
        return self.num_layers * (conv + state)


@dataclass(frozen=True)
class RecurrentLayerState:
    """One linear-attention layer's slots: conv [slots, channels, width] and
    recurrent [slots, heads, key_dim, value_dim]."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class RecurrentStateProvider(StateProvider):
    """One slot per running request, holding every linear-attention layer's state.

    A slot's size does not grow with the sequence, so `reserve` hands out one slot whatever
    the token count. Slots are not zeroed on reuse: a sequence that starts from its first
    token starts from zero state by itself (see `RecurrentMetadata.has_state`).
    """

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least one slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # owned by no request: padded rows may write there
        self._free = list(range(num_slots - 1, -1, -1))
        self._owned: dict[str, int] = {}
        slots = num_slots + 1
        conv = torch.zeros(
            (spec.num_layers, slots, spec.conv_channels, spec.conv_width), dtype=spec.conv_dtype, device=device
        )
        recurrent = torch.zeros(
            (spec.num_layers, slots, spec.num_heads, spec.key_dim, spec.value_dim),
            dtype=spec.state_dtype,
            device=device,
        )
        self._layers = tuple(RecurrentLayerState(conv[i], recurrent[i]) for i in range(spec.num_layers))

    def layer(self, index: int) -> RecurrentLayerState:
        return self._layers[index]

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        slot = self._owned.get(request_id)
        if slot is None:
            if not self._free:
                raise OutOfPagesError(f"request {request_id} needs a recurrent state slot but all are taken")
            slot = self._owned[request_id] = self._free.pop()
        return [slot]

    def release(self, request_id: str) -> None:
        slot = self._owned.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def free_capacity(self) -> int:
        return len(self._free)

    def total_capacity(self) -> int:
        return self.num_slots

    def held_by(self, request_id: str) -> list[int]:
        slot = self._owned.get(request_id)
        return [] if slot is None else [slot]

    @property
    def num_used_slots(self) -> int:
        return len(self._owned)
