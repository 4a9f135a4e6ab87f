"""Which cached prefix a request starts from, and what its steps leave in the prefix cache.

For a model of attention layers only, a cached prefix is its KV pages. A hybrid model's
linear-attention layers fold every token into a fixed-size recurrent state instead, so its
prefix is usable only up to a point where a copy of that state (a snapshot) was kept, as
SGLang's and vLLM's hybrid caches do. The planner stops prefill chunks at every multiple of
the snapshot interval; a chunk that ends there leaves its state in a snapshot as it runs
(the kernels write it beside the request's slot), and the prefix cache's node for those
tokens keeps it. A later request with that prefix shares the KV pages up to the deepest
node with a snapshot and starts from the snapshot.

With a host tier (`core/host_tier.py`), a prefix may run on past what the device still
caches into pages the device evicted to host memory: those are found by their prefix digests,
and copied into fresh device pages once every request admitted in the step has shared its
device pages (`load_from_host`), so that the room made for them never evicts a page another
admitted request was promised. A hybrid model's snapshots go to the tier too when the device
lets them go; a prefix then ends at the deepest snapshot either place keeps, and a snapshot
from host memory is copied into a device snapshot on that prefix's node.

Ownership: the KV pool's prefix cache holds the tree (and frees a node's snapshot with the
node); the recurrent provider owns the snapshot storage; the host tier owns its pages; this
class decides which prefix a request takes and which chunk ends are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.core.prefix_cache import ROOT_DIGEST, page_digest
from kestrel.core.recurrent_state import RECURRENT_GROUP, RecurrentStateProvider, chunk_ids
from kestrel.core.state import PagedKVProvider
from kestrel.engine.request import Request


@dataclass(frozen=True)
class PrefixHit:
    pages: list[int]  # cached KV pages of the prefix, in order
    snapshot: int | None = None  # hybrid models: the recurrent state after those pages
    host_digests: tuple[bytes, ...] = ()  # the prefix's next pages, in the host tier
    host_snapshot: bytes | None = None  # hybrid models: the state after the prefix, in the host tier

    def num_tokens(self, page_size: int) -> int:
        return (len(self.pages) + len(self.host_digests)) * page_size


NO_HIT = PrefixHit([])


class PrefixReuse:
    def __init__(self, kv: PagedKVProvider, recurrent: RecurrentStateProvider | None, snapshot_interval: int) -> None:
        self.kv = kv
        self.cache = kv.prefix_cache
        # Snapshots are kept only where the planner stops chunks for them (composition.py).
        self.snapshots = recurrent if recurrent is not None and self.cache is not None else None
        self.interval = snapshot_interval
        self._starting: dict[str, int] = {}  # admitted request -> the snapshot its first chunk reads
        self._loading: list[tuple[Request, PrefixHit]] = []  # admitted this step, with state to copy in
        self.tier = kv.host_tier
        if self.snapshots is not None and self.tier is not None:
            self.cache.on_snapshot_evicted = self._offload_snapshot
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, tokens a request did not compute again
        self.host_hit_tokens = 0  # of those, tokens copied back from the host tier

    def begin_step(self) -> None:
        if self.snapshots is not None:
            self.snapshots.reclaim_snapshots()

    def match(self, request: Request) -> PrefixHit:
        """The cached prefix the request may start from; never its whole sequence, whose last
        token must be computed to give logits, and nothing when prompt logprobs need every
        position."""
        if self.cache is None or request.params.prompt_logprobs is not None:
            return NO_HIT
        usable = (request.num_tokens - 1) // self.cache.page_size
        if self.snapshots is None:
            pages = self.cache.match(request.token_ids)[:usable]
            return PrefixHit(pages, host_digests=self._host_run(request.token_ids, pages, usable))
        pages, snapshot = self.cache.match_snapshot(request.token_ids, usable)
        deeper = self._host_snapshot_hit(request.token_ids, usable, len(pages)) if self.tier is not None else None
        return deeper or PrefixHit(pages, snapshot)

    def _host_snapshot_hit(self, tokens: list[int], usable: int, depth: int) -> PrefixHit | None:
        """A hybrid prefix ending at a snapshot the host tier keeps, deeper than `depth` pages
        (where the device's deepest one ends): device pages, then host pages, up to it."""
        device = self.cache.match(tokens)[:usable]
        digests = [self.cache.digest_of(page) for page in device] + list(self._host_run(tokens, device, usable))
        for end in range(len(digests), depth, -1):
            if digests[end - 1] in self.tier.snapshots:
                return PrefixHit(
                    device[:end], host_digests=tuple(digests[len(device) : end]), host_snapshot=digests[end - 1]
                )
        return None

    def _offload_snapshot(self, snapshot: int, digest: bytes) -> None:
        self.tier.snapshots.store(digest, *self.snapshots.unit_state(snapshot))

    def _host_run(self, tokens: list[int], pages: list[int], usable: int) -> tuple[bytes, ...]:
        """The digests of the pages after `pages` that the host tier holds, up to `usable`."""
        tier = self.tier
        if tier is None or len(pages) >= usable:
            return ()
        size = self.cache.page_size
        digest = self.cache.digest_of(pages[-1]) if pages else ROOT_DIGEST
        run = []
        for index in range(len(pages), usable):
            digest = page_digest(digest, tokens[index * size : (index + 1) * size])
            if digest not in tier:
                break
            run.append(digest)
        return tuple(run)

    def take(self, request: Request, hit: PrefixHit) -> None:
        """Start an admitted request from its hit: share the pages (its first chunk reads the
        snapshot), and count its computed tokens."""
        if self.cache is not None:
            self.queried_tokens += request.num_tokens
            self.hit_tokens += len(hit.pages) * self.cache.page_size
        if hit.host_digests or hit.host_snapshot is not None:
            self._loading.append((request, hit))
        if not hit.pages:
            return
        self.kv.share(request.request_id, hit.pages)
        if hit.snapshot is not None:
            self._starting[request.request_id] = hit.snapshot
        request.num_computed_tokens = len(hit.pages) * self.cache.page_size

    def load_from_host(self) -> None:
        """Copy in the host-tier pages (and snapshot) of the requests `take` started this step,
        after every admitted request has shared its device pages. Pages the tier let go since
        `match` are computed again instead (the request's first chunk then starts earlier); a
        hybrid request whose snapshot cannot be brought back starts from its first token."""
        loading, self._loading = self._loading, []
        if not loading:
            return
        # Pinned before any copy in: the room those copies take sends evicted state to the tier.
        held = [(request, hit, self.tier.hold(hit.host_digests), self._hold_snapshot(hit)) for request, hit in loading]
        for request, hit, host_pages, snapshot in held:
            self._load(request, hit, host_pages, snapshot)
            self.tier.release(host_pages)
            if snapshot is not None:
                self.tier.snapshots.release([snapshot])

    def _hold_snapshot(self, hit: PrefixHit) -> int | None:
        if hit.host_snapshot is None:
            return None
        held = self.tier.snapshots.hold([hit.host_snapshot])
        return held[0] if held else None

    def _load(self, request: Request, hit: PrefixHit, host_pages: list[int], snapshot: int | None) -> None:
        size = self.cache.page_size
        if hit.host_snapshot is not None and (snapshot is None or len(host_pages) < len(hit.host_digests)):
            self._start_over(request, hit)  # the state at the prefix's end is gone
            return
        num_device_pages = request.num_computed_tokens // size
        pages = self.kv.reserve(request.request_id, (num_device_pages + len(host_pages)) * size)
        self.kv.load_from_host(host_pages, pages[num_device_pages:])
        request.num_computed_tokens = len(pages) * size
        prefix = request.token_ids[: request.num_computed_tokens]
        self.kv.cache_prefix(request.request_id, prefix)
        if snapshot is not None:
            unit = self._restore_snapshot(prefix, snapshot)
            if unit is None:
                self._start_over(request, hit)
                return
            self._starting[request.request_id] = unit
        self.hit_tokens += len(host_pages) * size
        # Tokens reused through the tier: its pages, or the whole prefix its snapshot made usable.
        self.host_hit_tokens += request.num_computed_tokens if snapshot is not None else len(host_pages) * size

    def _restore_snapshot(self, prefix: list[int], host_snapshot: int) -> int | None:
        """A device snapshot of the state after `prefix`, on its node: one kept there already,
        or a fresh one filled from the host tier; None where none can be had."""
        kept = self.cache.snapshot_at(prefix)
        if kept is not None:
            return kept
        unit = self._keep_state(prefix)
        if unit is None:
            return None
        for target, source in zip(self.snapshots.unit_state(unit), self.tier.snapshots.page(host_snapshot)):
            target.copy_(source, non_blocking=True)
        return unit

    def _start_over(self, request: Request, hit: PrefixHit) -> None:
        """Give back what the request was given and compute its prompt from the start."""
        self.hit_tokens -= len(hit.pages) * self.cache.page_size  # counted by `take`
        self.kv.release(request.request_id)
        request.num_computed_tokens = 0

    def after_chunk(self, request: Request, start: int, end: int, state_ids: dict[str, tuple[int, ...]]) -> None:
        """Cache what the chunk [start, end) computes: the prompt's pages once the prompt is
        done; on a hybrid model, the state at a snapshot stop. A hybrid chunk's recurrent ids
        (`state_ids`) then also name the snapshot it starts from and the one it saves to."""
        at_stop = self.snapshots is not None and end % self.interval == 0 and end <= request.num_tokens
        if start < request.num_prompt_tokens <= end or at_stop:
            # The chunk's KV is queued: later requests with the same prefix can share it.
            self.kv.cache_prefix(request.request_id, request.token_ids[:end])
        if self.snapshots is None:
            return
        read_from = self._starting.pop(request.request_id, None)
        save_to = self._keep_state(request.token_ids[:end]) if at_stop else None
        if read_from is None and save_to is None:
            return  # the provider's own ids stand (a verify chunk's spare slot among them)
        (slot,) = state_ids[RECURRENT_GROUP]
        state_ids[RECURRENT_GROUP] = chunk_ids(slot, read_from, save_to)

    def _keep_state(self, tokens: list[int]) -> int | None:
        """A snapshot for the state after `tokens` (cached whole pages), on their node; None
        where one is kept already or none can be had."""
        if not self.cache.snapshot_wanted(tokens):
            return None
        snapshot = self.snapshots.allocate_snapshot()
        if snapshot is None:
            # Only a snapshot whose pages no request holds is taken back: one a running
            # request starts from, or a chunk of this step saves to, sits on held pages.
            snapshot = self.cache.evict_snapshot(lambda page: not self.kv.allocator.is_held(page))
        if snapshot is not None:
            self.cache.attach_snapshot(tokens, snapshot)
        return snapshot

    def release(self, request: Request) -> None:
        """A request gives its pages back: its computed full pages stay cached."""
        self._starting.pop(request.request_id, None)
        self.kv.cache_prefix(request.request_id, request.token_ids[: request.num_computed_tokens])
