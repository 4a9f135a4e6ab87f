"""Per-request state memory: the specs state groups declare, and their providers.

A recipe's layers name the state group they keep their state in (`KV_GROUP` for paged keys
and values, `RECURRENT_GROUP` for linear-attention slots, or a group of their own); the
composition root builds one `StateProvider` per group, and `StateGroup` pairs it with the
`StepBinder` that makes its per-step metadata.

Ownership: a provider owns every unit (page, slot) of its pool. A request owns the units
reserved for it from `reserve` until `release`; nobody else frees them. `rollback` gives back
what a request reserved past a point (rejected draft tokens), `export` / `import_state`
copy what it holds to host memory and back (`core/transfer.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kestrel.core.binder import StepBinder
from kestrel.core.host_tier import HostKVTier
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
    # MLA: values are the first `latent_dim` dims of each key, so only keys are stored.
    latent_dim: int | None = None

    @property
    def kinds(self) -> int:
        """Tensors stored per layer: keys and values, or keys alone (latent)."""
        return 1 if self.latent_dim is not None else 2

    def bytes_per_page(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.kinds * self.num_layers * self.num_kv_heads * self.head_dim * element_size
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
            self._free.extend(reversed(self.prefix_cache.evict(lambda p: self._refs[p] == 0)))
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
            self._drop_ref(page)

    def _drop_ref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] > 0:
            return
        self._num_used -= 1
        if self.prefix_cache is not None and page in self.prefix_cache:
            self.prefix_cache.offer(page)  # unused but cached: evictable from now on
        else:
            self._free.append(page)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's pages past the ones `num_tokens` tokens fill."""
        pages = self._owned.get(request_id, [])
        keep = self.pages_needed(num_tokens)
        while len(pages) > keep:
            self._drop_ref(pages.pop())

    def is_held(self, page: int) -> bool:
        """Whether any request holds the page (a cached page no request holds is evictable)."""
        return self._refs[page] > 0

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

    scratch_id: int  # a unit no request ever owns: padded rows of a captured graph write there

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

    @abstractmethod
    def rollback(self, request_id: str, num_tokens: int) -> int:
        """Forget the request's state past its first `num_tokens` tokens (rejected draft
        tokens); return how many tokens of state it keeps, which the caller recomputes from."""

    def mark_rollback_point(self, request_id: str, num_tokens: int) -> None:
        """The request's next chunk is tentative (a verify chunk): keep its state after its
        first `num_tokens` tokens recoverable until the next `rollback`. Called before that
        chunk's `reserve`. Nothing to do where state is per position (pages are overwritten
        in place), so by default nothing is done."""
        return None

    @abstractmethod
    def export(self, request_id: str, place: torch.device) -> list[torch.Tensor]:
        """Copies of the request's state on `place` (host memory, or device memory another
        process maps); its units stay owned until `release`."""

    @abstractmethod
    def import_state(self, request_id: str, num_tokens: int, state: list[torch.Tensor]) -> list[int]:
        """Reserve room for `num_tokens` tokens and write `export`'s copies into it."""

    def export_layout(self, num_tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each tensor `export` gives for a request of `num_tokens`
        tokens: what state from another instance must look like to be imported here."""
        raise NotImplementedError(f"{type(self).__name__} cannot import another instance's state")

    def check_import(self, num_tokens: int, state: list[torch.Tensor]) -> None:
        """Raise ValueError, saying what differs, where `state` is not what this pool exports."""
        expected = self.export_layout(num_tokens)
        got = [(tuple(t.shape), t.dtype) for t in state]
        if got != expected:
            raise ValueError(f"state of {num_tokens} tokens: expected tensors {expected}, got {got}")

    @abstractmethod
    def layer(self, index: int) -> object:
        """The pool's view of one of the group's layers, as its layers read it."""


@dataclass(frozen=True)
class KVLayout:
    """How a backend wants the paged pool laid out: head-major pages, and whether each
    page's values are stored slot-minor (a float8 pool read by the Triton kernels)."""

    values_by_slot: bool = False


@dataclass(frozen=True)
class KVLayerCache:
    """The key and value pages of one layer: each [num_kv_heads, num_pages, page_size, head_dim].

    Head-major, so gathering a sequence's pages yields one contiguous [tokens, head_dim]
    block per head: the layout attention kernels read fastest. A float8 pool stores each
    page's values slot-minor ([head_dim, page_size] in memory; `value` is a strided view,
    `values_by_slot`): a kernel then reads them as the second dot needs them, along the
    keys, in whole vectors rather than byte by byte. A latent pool (MLA) stores keys only:
    `value` is a view of each key's leading `latent_dim` dims.
    """

    key: torch.Tensor
    value: torch.Tensor
    layer_index: int = 0  # its index in the pool: a backend keys per-layer caches by it
    values_in_keys: bool = False  # a latent pool: storing the keys stores the values

    @property
    def values_by_slot(self) -> bool:
        return self.value.stride(-1) != 1


class PagedKVProvider(StateProvider):
    """The paged KV pool for every full-attention layer, sized from an explicit byte budget."""

    def __init__(
        self,
        spec: KVCacheSpec,
        budget_bytes: int,
        device: torch.device,
        enable_prefix_caching: bool = False,
        layout: KVLayout | None = None,  # the backend's `kv_layout`; by default, as for the dtype
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
        self.scratch_id = num_pages
        self.layout = layout or KVLayout(values_by_slot=spec.dtype in FLOAT8_KV_DTYPES)
        self.host_tier: HostKVTier | None = None  # `attach_host_tier`
        shape = (spec.num_layers, spec.kinds, spec.num_kv_heads, num_pages + 1, spec.page_size, spec.head_dim)
        # Zeros, not empty: masked-out positions are multiplied by zero weights, and
        # uninitialised memory may hold NaN, which would survive that multiplication.
        self._storage = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._layers = tuple(self._layer_cache(layer, index) for index, layer in enumerate(self._storage.unbind(0)))

    def _layer_cache(self, pages: torch.Tensor, index: int) -> KVLayerCache:
        if self.spec.latent_dim is not None:
            keys = pages[0]
            return KVLayerCache(keys, keys[..., : self.spec.latent_dim], index, values_in_keys=True)
        return KVLayerCache(key=pages[0], value=self._values(pages[1]), layer_index=index)

    def _values(self, pages: torch.Tensor) -> torch.Tensor:
        """One layer's value pages, as KVLayerCache describes them."""
        if not self.layout.values_by_slot:
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

    def rollback(self, request_id: str, num_tokens: int) -> int:
        self.allocator.truncate(request_id, num_tokens)
        return num_tokens  # keys and values past it are simply overwritten later

    def export(self, request_id: str, place: torch.device) -> list[torch.Tensor]:
        """Every layer's keys and values of the request's pages: [layers, kinds, heads, pages, page, dim]."""
        pages = torch.tensor(self.allocator.pages_of(request_id), dtype=torch.long, device=self._storage.device)
        return [self._storage.index_select(3, pages).to(place, non_blocking=False)]

    def export_layout(self, num_tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        layers, kinds, heads, page_size, head_dim = self.page_shape()
        pages = self.allocator.pages_needed(num_tokens)
        return [((layers, kinds, heads, pages, page_size, head_dim), self._storage.dtype)]

    def import_state(self, request_id: str, num_tokens: int, state: list[torch.Tensor]) -> list[int]:
        pages = self.reserve(request_id, num_tokens)
        (copied,) = state
        if copied.shape[3] != len(pages):
            raise ValueError(f"request {request_id}: {copied.shape[3]} exported pages, {len(pages)} reserved")
        index = torch.tensor(pages, dtype=torch.long, device=self._storage.device)
        self._storage.index_copy_(3, index, copied.to(self._storage.device))
        return pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_used_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages held only by the prefix cache."""
        return self.allocator.num_cached_pages

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.allocator.prefix_cache

    def share(self, request_id: str, pages: list[int]) -> None:
        self.allocator.share(request_id, pages)

    def page_shape(self) -> tuple[int, ...]:
        """One page of every layer's keys and values, as stored: [layers, 2, heads, page, dim]."""
        layers, kinds, heads, _, page_size, head_dim = self._storage.shape
        return (layers, kinds, heads, page_size, head_dim)

    def attach_host_tier(self, tier: HostKVTier) -> None:
        """Keep the pages the prefix cache evicts in `tier` (copied before they are reused)."""
        if self.prefix_cache is None:
            raise ValueError("a host KV tier keeps evicted prefix-cache pages; enable prefix caching")
        self.host_tier = tier
        self.prefix_cache.on_page_evicted = self._offload

    def _offload(self, page: int, digest: bytes) -> None:
        self.host_tier.store(digest, self._storage[:, :, :, page])

    def load_from_host(self, host_pages: list[int], pages: list[int]) -> None:
        """Copy held host-tier pages into device `pages` (the caller's, in the same order)."""
        for host_page, page in zip(host_pages, pages, strict=True):
            (contents,) = self.host_tier.page(host_page)
            self._storage[:, :, :, page].copy_(contents, non_blocking=True)

    def cache_prefix(self, request_id: str, token_ids: list[int]) -> None:
        """Record the request's full pages of `token_ids` (whose KV is computed) for reuse."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(token_ids, self.allocator.pages_of(request_id))


@dataclass(frozen=True)
class StateGroup:
    """One state group at run time: its provider, and the binder of its per-step metadata
    (the attention backend for a KV group; the provider itself for recurrent state)."""

    name: str
    provider: StateProvider
    binder: StepBinder
