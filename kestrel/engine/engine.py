"""LLMEngine: the request lifecycle around one planner and one runner.

Each step: plan -> release preempted -> reserve pages -> launch -> read the previous step's
results (append tokens, detokenize, check stops, release finished requests' pages).

With overlapped (async) scheduling the engine plans and launches step N+1 before it reads
step N's samples, so the host's work hides behind the device's. A request whose token from
step N is still on the device counts it as pending: the planner sees it, and step N+1 takes
the token from the device. A request that step N finishes (a stop token) has had one more
token computed in step N+1, which is dropped; its pages are freed while step N+1 may still
write to them, which is safe because the device runs steps in order, so no later step's
reader can see those writes before it overwrites them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kestrel.config import EngineArgs
from kestrel.core.batch import KV_GROUP
from kestrel.core.planner import Capacity, QueueState, RequestView, ScheduledChunk, StepPlan
from kestrel.core.runner import PendingStep, SequenceResult, SequenceWork
from kestrel.core.sampling import SampledToken, TokenLogprobs
from kestrel.core.transfer import StateCopy, TransferHandle
from kestrel.engine.admission import check_prompt_tokens, resolve_max_tokens
from kestrel.engine.composition import EngineParts, build_engine_parts
from kestrel.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from kestrel.engine.draft_model import DraftModelProposer
from kestrel.engine.mtp_proposer import MtpProposer
from kestrel.engine.output_shaping import OutputShaper
from kestrel.engine.outputs import RequestOutput
from kestrel.engine.prefix_reuse import NO_HIT, PrefixHit, PrefixReuse
from kestrel.engine.reasoning import reasoning_format
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.speculative import DraftAsk, Speculation, SpeculationStats, kept_samples
from kestrel.engine.structured_outputs import GrammarCache, StructuredOutputs
from kestrel.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kestrel.engine")
PREEMPTION_WARNING_EVERY = 100
GRAMMAR_WAIT_SECONDS = 0.05


@dataclass
class _InFlightStep:
    """A launched step whose results the engine has not taken in yet."""

    requests: dict[str, Request]  # by id, as scheduled: an id may be reused once retired
    pending: PendingStep
    results: tuple[SequenceResult, ...] | None = None  # once read from the device


class _MasksAfterLastStep:
    """The token masks of a step launched before the previous step's samples were read
    (overlapped scheduling). The runner asks for masks only once the step's forward pass is
    queued; the first question reads the previous step's samples and advances the grammars
    by them, so the host waits for the device while the device runs the forward pass."""

    def __init__(
        self,
        structured: StructuredOutputs,
        read_last_step: Callable[[], None],
        drafts: Mapping[str, Sequence[int]],  # the step's verify chunks' drafts, by request
    ) -> None:
        self.structured, self.read_last_step, self.drafts = structured, read_last_step, drafts

    def constrained(self, request_id: str) -> bool:
        self.read_last_step()
        return self.structured.constrained(request_id)

    def fill(self, request_ids: Sequence[str]) -> torch.Tensor:
        self.read_last_step()
        return self.structured.fill(request_ids, self.drafts)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_used_pages: int
    num_cached_pages: int  # held only by the prefix cache
    num_total_pages: int
    num_used_state_slots: int  # hybrid models: recurrent state slots held by requests
    num_total_state_slots: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens whose KV was reused
    num_preemptions: int  # requests preempted for pages since start (vLLM's num_preemptions)
    # The host KV tier, since start: of the hits, tokens reused through it (its pages, or a
    # hybrid prefix its snapshot made usable); bytes copied out to it and back in.
    kv_offload_hit_tokens: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_loaded_bytes: int = 0
    structured_requests: int = 0  # requests with a structured-output constraint, so far
    grammars_compiled: int = 0
    grammar_compile_seconds: float = 0.0  # on the compile threads, all grammars so far
    grammar_mask_steps: int = 0  # steps that filled token masks, and the host time it took
    grammar_mask_seconds: float = 0.0
    # Speculative decoding, since start (vLLM's spec_decode counters).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.parts: EngineParts = build_engine_parts(args)
        self.tokenizer = self.parts.tokenizer
        self.outputs = OutputShaper(self.tokenizer)
        self.max_model_len = self.parts.max_model_len
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._seeds = random.Random(args.seed)
        self._prefix = PrefixReuse(self.parts.kv, self.parts.recurrent, args.state_snapshot_interval)
        self._prefix_hits: dict[str, PrefixHit] = {}  # this step's cache hits of waiting requests
        self._overlap = args.async_scheduling
        # Moves requests' state to host memory and back: preempted requests (with
        # preemption_mode "swap"), and prompts handed between prefill and decode instances.
        self._transfer = StateCopy(self.parts.groups)
        # Where a prefill request's state goes when it finishes (kv_buffer_device).
        self._exports = StateCopy(self.parts.groups, self._export_place(args))
        self._swap_preempted = args.preemption_mode == "swap"
        self.num_preemptions = 0  # requests preempted for pages, since start
        self.num_swapped_out = 0  # of those, the ones that kept their state in host memory
        self._in_flight: _InFlightStep | None = None
        self.structured = self._structured_outputs(args)
        # Per constrained request of the step being read: whether its grammar stayed open
        # after each sample (advanced as soon as the samples reach the host).
        self._grammar_open: dict[str, list[bool]] = {}
        self.speculation = self._speculation(args)

    def _speculation(self, args: EngineArgs) -> Speculation | None:
        if args.speculative_config is None:
            return None
        draft = self.parts.draft
        if args.speculative_config.method == "draft_model":
            proposer = DraftModelProposer(draft.runner, draft.kv, draft.max_model_len, draft.max_num_batched_tokens)
            return Speculation(args.speculative_config, proposer)
        if args.speculative_config.method == "mtp":
            head = draft.runner.model
            proposer = MtpProposer(draft.runner, draft.kv, draft.max_model_len, draft.max_num_batched_tokens, head)
            return Speculation(args.speculative_config, proposer)
        return Speculation(args.speculative_config)

    def _structured_outputs(self, args: EngineArgs) -> StructuredOutputs | None:
        """The matchers of constrained requests; None for a model without a tokenizer."""
        if self.tokenizer is None:
            return None
        grammars = GrammarCache(self.tokenizer, self.parts.spec.vocab_size, self.parts.eos_token_ids)
        end = (
            ()
            if args.reasoning_parser is None
            else reasoning_format(args.reasoning_parser).end_token_ids(self.tokenizer)
        )
        return StructuredOutputs(grammars, end)

    # ---- admission -------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a prompt this engine cannot run; touches no state."""
        vocab = self.parts.spec.vocab_size
        check_prompt_tokens(prompt_token_ids, vocab)
        named = [t for t in params.token_ids_named() if t >= vocab]
        if named:
            raise ValueError(f"token ids in the sampling params out of range [0, {vocab}): {named[:5]}")
        resolve_max_tokens(len(prompt_token_ids), params.max_tokens, self.max_model_len, strict=False)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        export_state: bool = False,
        imported_state: TransferHandle | None = None,
    ) -> None:
        """Queue a request. Disaggregated serving: `export_state` (a prefill instance) computes
        the prompt, samples nothing, and hands its state out in the finished output's
        `kv_state`; `imported_state` (a decode instance) starts the request from a prefill
        instance's state of every prompt token but the last."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("the engine runs one sequence per request; fan n > 1 out into requests")
        params = self._with_bad_words_tokenized(params)
        self.validate_prompt(prompt_token_ids, params)
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            self.structured.add(request_id, params.structured_outputs, prompt_token_ids)
        max_tokens = resolve_max_tokens(len(prompt_token_ids), params.max_tokens, self.max_model_len, strict=False)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            max_tokens=max_tokens,
            detokenizer=detokenizer,
            prompt=prompt,
            arrival_time=time.monotonic(),
        )
        if export_state or imported_state is not None:
            self._check_handoff(request, imported_state)
        request.export_state = export_state
        if export_state:
            request.max_tokens = 0
        if imported_state is not None and imported_state.num_tokens:
            # Imported at admission, as a swapped-out request is, under this request's id.
            request.swapped = dataclasses.replace(imported_state, request_id=request_id)
            request.num_computed_tokens = imported_state.num_tokens
        self._requests[request_id] = request
        self._waiting.append(request)

    def _export_place(self, args: EngineArgs) -> torch.device:
        if args.kv_buffer_device == "cpu":
            return torch.device("cpu")
        device = self.parts.runtime.device
        if device.type != "cuda":
            raise ValueError(f"kv_buffer_device='cuda' keeps exported state on the GPU; this engine runs on {device}")
        return device

    def _check_handoff(self, request: Request, imported: TransferHandle | None) -> None:
        if self.parts.args.tensor_parallel_size > 1:
            raise ValueError("prefill/decode handoff moves rank 0's state only; not with tensor parallelism yet")
        if imported is None:
            return
        if request.params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need every prompt position computed here, not a prefill instance's state")
        if imported.num_tokens != request.num_prompt_tokens - 1:
            raise ValueError(
                f"the prefill instance computed {imported.num_tokens} tokens; this prompt has "
                f"{request.num_prompt_tokens} (the two instances tokenized it differently)"
            )
        self._transfer.check_import(imported)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        request.finish("abort")
        return self._retire(request)

    # ---- the step --------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running or self._in_flight)

    def step(self) -> list[RequestOutput]:
        outputs = self._fail_broken_grammars()
        if self._in_flight is not None and self._needs_host_tokens():
            outputs += self._read_in_flight()
        kv = self.parts.kv
        if self.speculation is not None:
            self._draft()
        self._prefix.begin_step()
        plan = self.parts.planner.plan(self._queue_state(), Capacity(kv.free_capacity(), kv.spec.page_size))
        self._apply(plan)
        work = [self._work_for(chunk) for chunk in plan.scheduled]
        requests = {chunk.request_id: self._requests[chunk.request_id] for chunk in plan.scheduled}
        masks = None
        if self.structured:
            drafts = {r.request_id: r.draft_token_ids for r in requests.values() if r.draft_token_ids}
            masks = _MasksAfterLastStep(self.structured, self._read_results, drafts)
        launched = self.parts.executor.launch(work, masks) if work else None
        outputs += self._read_in_flight()  # the previous step's results, while this one runs
        if launched is not None:
            self._in_flight = _InFlightStep(requests, launched)
            # A verify step's outcome decides what its requests run next: read before planning.
            if not self._overlap or any(r.draft_token_ids for r in requests.values()):
                outputs += self._read_in_flight()
        elif not outputs and self.structured:
            self.structured.wait_for_grammars(GRAMMAR_WAIT_SECONDS)  # nothing runs until one compiles
        return outputs

    def _draft(self) -> None:
        """Drafts for every running request that decodes next (its prompt computed, its last
        token known). A constrained request's drafts end where its grammar would refuse one;
        while it is still reasoning (no mask yet) it decodes one token at a time."""
        asks = []
        for request in self._running:
            request.draft_token_ids = ()
            if not self.speculation.drafts_now(request.request_id):
                self.speculation.pass_step(request.request_id)
                continue
            # Its prompt computed and every sample read; after a rejection on a hybrid model
            # the accepted tokens are computed again in the same chunk as the new drafts.
            decodes = request.num_computed_tokens >= request.num_prompt_tokens and not request.num_pending_tokens
            constrained = request.params.structured_outputs is not None
            if not decodes or (constrained and not self.structured.constrained(request.request_id)):
                continue
            room = request.max_tokens - request.num_output_tokens - 1  # the sample after the drafts
            asks.append(DraftAsk(request.request_id, request.token_ids, room))
        for request_id, drafts in self.speculation.drafts_for(asks).items():
            if drafts and self._requests[request_id].params.structured_outputs is not None:
                drafts = self.structured.valid_drafts(request_id, drafts)
            self._requests[request_id].draft_token_ids = drafts
            if not drafts:
                self.speculation.record_outcome(request_id, 0)

    def _fail_broken_grammars(self) -> list[RequestOutput]:
        """Finish the waiting requests whose grammar failed to compile (it was checked when
        the request came, so this is the compiler's fault, not the request's)."""
        if not self.structured:
            return []
        broken = [r for r in self._waiting if self.structured.failed(r.request_id) is not None]
        for request in broken:
            logger.error(
                "request %s: its grammar failed to compile: %s",
                request.request_id,
                self.structured.failed(request.request_id),
            )
            request.finish("abort")
        return [self._retire(request) for request in broken]

    def _with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """Each bad word's token ids, as the word starts a text and as it follows a space (vLLM's rule)."""
        if not params.bad_words or params.bad_words_token_ids:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none (pass bad_words_token_ids)")
        words = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in words:
                    words.append(ids)
        return params.replace(bad_words_token_ids=tuple(words))

    def _needs_host_tokens(self) -> bool:
        """Whether the next step's work depends on results still on the device: penalties and
        bad words read every output token, prompt logprobs continue from the last chunk's, and
        drafts follow the last token.
        (A grammar's next mask follows the last token too, but only the sampler needs it,
        after the forward pass is queued: `_MasksAfterLastStep`.)"""
        return any(
            r.params.needs_output_tokens or r.wants_prompt_logprobs or self._drafts_next(r) for r in self._running
        )

    def _drafts_next(self, request: Request) -> bool:
        """Whether the request may draft in the step being planned: drafts follow its last
        token, which must be on the host (a pausing request lets the steps overlap)."""
        spec = self.speculation
        return (
            spec is not None
            and request.num_computed_tokens >= request.num_prompt_tokens
            and spec.drafts_now(request.request_id)
        )

    def _read_results(self) -> None:
        """Wait for the step in flight and advance its requests' grammars by its samples,
        once; `_read_in_flight` then takes the rest of its results in."""
        in_flight = self._in_flight
        if in_flight is None or in_flight.results is not None:
            return
        in_flight.results = in_flight.pending.result().results
        if not self.structured:
            return
        for result in in_flight.results:
            request = in_flight.requests[result.request_id]
            if request.status is not RequestStatus.FINISHED and result.request_id in self.structured:
                sampled = [s.token_id for s in result.sampled]
                if request.draft_token_ids:  # only a verify chunk's samples that stand
                    sampled = sampled[: kept_samples(sampled, request.draft_token_ids)]
                self._grammar_open[result.request_id] = [self.structured.accept(result.request_id, t) for t in sampled]

    def _read_in_flight(self) -> list[RequestOutput]:
        self._read_results()
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        return self._absorb(in_flight.requests, in_flight.results)

    def _queue_state(self) -> QueueState:
        # The planner admits at most one request per free seat, in queue order: requests
        # further back cannot run this step, so neither their views nor their prefix
        # lookups are built (with hundreds waiting, that cost milliseconds per step).
        seats = max(0, self.parts.planner.config.max_num_seqs - len(self._running))
        # A request swapped out while its last sample was in flight waits for that token.
        ready = (r for r in self._waiting if (r.swapped is None or not r.num_pending_tokens) and self._grammar_ready(r))
        candidates = list(itertools.islice(ready, seats))
        self._prefix_hits = {r.request_id: self._prefix.match(r) for r in candidates}
        return QueueState(
            waiting=tuple(self._waiting_view(r) for r in candidates),
            running=tuple(self._view(r) for r in self._running if not self._ends_with_pending(r)),
        )

    def _grammar_ready(self, request: Request) -> bool:
        return request.params.structured_outputs is None or self.structured.is_ready(request.request_id)

    @staticmethod
    def _ends_with_pending(request: Request) -> bool:
        """A token still on the device will be the request's last: nothing more to plan."""
        return request.num_pending_tokens > 0 and request.num_output_tokens + request.num_pending_tokens >= (
            request.max_tokens
        )

    def _waiting_view(self, request: Request) -> RequestView:
        # Cached (or swapped-out) tokens count as computed: they cost no token budget; the
        # pages to swap back in count as new pages.
        if request.swapped is not None:
            return RequestView(request.request_id, request.num_tokens, request.swapped.num_tokens, 0)
        cached = self._prefix_hits[request.request_id].num_tokens(self.parts.kv.spec.page_size)
        return RequestView(request.request_id, request.num_tokens, cached, 0)

    def _count_preemption(self, request_id: str) -> None:
        """Count a preemption, and warn of the first and every hundredth (as vLLM does): a
        preempted request's work is redone or copied back, so a server that keeps preempting
        wants more KV memory or fewer sequences at once."""
        self.num_preemptions += 1
        if self.num_preemptions == 1 or self.num_preemptions % PREEMPTION_WARNING_EVERY == 0:
            how = "its state moved to host memory" if self._swap_preempted else "its KV to be recomputed"
            logger.warning(
                "request %s preempted (%s): the KV cache is full (preemptions so far: %d); raise "
                "--gpu-memory-utilization or --kv-cache-memory-gb, or lower --max-num-seqs, to avoid them",
                request_id,
                how,
                self.num_preemptions,
            )

    def _view(self, request: Request) -> RequestView:
        pages = len(self.parts.kv.held_by(request.request_id))
        num_tokens = request.num_planned_tokens + len(request.draft_token_ids)
        return RequestView(request.request_id, num_tokens, request.num_computed_tokens, pages)

    def _apply(self, plan: StepPlan) -> None:
        for request_id in plan.preempted:  # newest first, so the oldest ends up at the front
            request = self._requests[request_id]
            self._count_preemption(request_id)
            self._running.remove(request)
            request.draft_token_ids = ()
            if self._swap_preempted:
                request.swapped = self._transfer.export(request_id, request.num_computed_tokens)
                self.num_swapped_out += 1
            self._release_pages(request)
            request.status = RequestStatus.WAITING
            if request.swapped is None:
                request.num_computed_tokens = 0
                if request.wants_prompt_logprobs:
                    request.prompt_logprobs = [None]  # recomputed from the start, like the KV
            self._waiting.appendleft(request)
        admitted = [self._requests[request_id] for request_id in plan.admitted]
        for request in admitted:
            self._waiting.remove(request)
            if request.swapped is None:
                self._prefix.take(request, self._prefix_hits.get(request.request_id, NO_HIT))
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self._running.append(request)
        # Only once every admitted request shares its cached pages: the room taken here may
        # evict cached pages, and none of those may be a page an admitted request was promised.
        for request in admitted:
            if request.swapped is not None:
                self._transfer.import_(request.swapped)  # its pages and slots, filled from host memory
                request.swapped = None
        self._prefix.load_from_host()

    def _release_pages(self, request: Request) -> None:
        """Give the request's pages back, leaving its computed full pages in the prefix cache."""
        self._prefix.release(request)
        for group in self.parts.groups.values():
            group.provider.release(request.request_id)

    def _work_for(self, chunk: ScheduledChunk) -> SequenceWork:
        """Resolve a chunk into the runner's work, and count it as computed: its KV is written
        by the time any later step reads it, because the device runs steps in order."""
        request = self._requests[chunk.request_id]
        start = request.num_computed_tokens
        end = start + chunk.num_new_tokens
        # A verify chunk: its drafts follow the last token (a chunk cut short checks fewer).
        drafts = request.draft_token_ids = request.draft_token_ids[: max(0, end - request.num_tokens)]
        for group in self.parts.groups.values() if drafts else ():
            group.provider.mark_rollback_point(request.request_id, start)
        state_ids = {
            name: tuple(group.provider.reserve(request.request_id, end)) for name, group in self.parts.groups.items()
        }
        self._prefix.after_chunk(request, start, end, state_ids)
        pages = state_ids.pop(KV_GROUP)
        params = request.params
        follows = end > request.num_tokens and not drafts  # its last token is the pending one, on the device
        sample = end >= request.num_planned_tokens and request.max_tokens > 0
        work = SequenceWork(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids[start:end]) + (drafts if drafts else (0,) if follows else ()),
            num_cached_tokens=start,
            page_ids=tuple(pages),
            num_samples=int(sample) + len(drafts),
            params=params,
            seed=request.seed,
            prompt_token_ids=request.prompt_token_ids if params.needs_output_tokens else (),
            output_token_ids=request.output_token_ids if params.needs_output_tokens else (),
            prompt_logprob_targets=self._prompt_logprob_targets(request, start, end),
            state_ids=state_ids,
            follows_last_sample=follows,
        )
        request.num_computed_tokens = end
        request.num_pending_tokens += work.num_samples
        return work

    def _prompt_logprob_targets(self, request: Request, start: int, end: int) -> tuple[int, ...]:
        if not request.wants_prompt_logprobs or start != len(request.prompt_logprobs) - 1:
            return ()
        stop = min(end, request.num_prompt_tokens - 1)
        return tuple(request.token_ids[start + 1 : stop + 1])

    def _absorb(self, requests: dict[str, Request], results: tuple[SequenceResult, ...]) -> list[RequestOutput]:
        outputs = []
        for result in results:
            request = requests[result.request_id]
            request.num_pending_tokens -= len(result.sampled)
            if request.status is RequestStatus.FINISHED:
                continue  # finished (or aborted) while this step ran: its extra tokens are dropped
            if result.prompt_logprobs:
                request.prompt_logprobs.extend(self.outputs.position_logprobs(lp) for lp in result.prompt_logprobs)
            sampled_tokens = result.sampled
            num_standing = request.num_tokens  # positions whose hidden states stand
            if request.draft_token_ids:
                sampled_tokens = self._verified(request, sampled_tokens)
                num_standing += len(sampled_tokens) - 1  # the accepted drafts
            if result.hidden_states is not None:
                first, states = result.hidden_states.first_position, result.hidden_states.states
                self.speculation.observe(request.request_id, first, states[: max(0, num_standing - first)])
            grammar_open = self._grammar_open.pop(request.request_id, ())
            for index, sampled in enumerate(sampled_tokens):
                open_after = grammar_open[index] if index < len(grammar_open) else True
                self._append_token(request, sampled.token_id, sampled.logprobs, open_after)
                if request.status is RequestStatus.FINISHED:
                    break  # a stop: the samples after it are dropped
            if not result.sampled and request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                request.finish("length")
            if request.status is RequestStatus.FINISHED:
                outputs.append(self._retire(request))
            elif result.sampled and request.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(request))
        return outputs

    def _verified(self, request: Request, sampled: tuple[SampledToken, ...]) -> tuple[SampledToken, ...]:
        """A verify chunk's samples that stand; the rejected drafts' state is rolled back."""
        drafts, request.draft_token_ids = request.draft_token_ids, ()
        kept, standing = self.speculation.verify([s.token_id for s in sampled], drafts)
        accepted = kept - 1
        self.speculation.stats.record(len(drafts), accepted)
        self.speculation.record_outcome(request.request_id, accepted)
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += accepted
        # State stands for the last token and the accepted drafts; the kept sample after them
        # is the next step's input. A group that keeps less (recurrent state, which keeps the
        # state before the chunk) takes the others back with it.
        wanted = request.num_tokens + accepted
        groups = self.parts.groups.values()
        computed = min(group.provider.rollback(request.request_id, wanted) for group in groups)
        if computed < wanted:
            for group in groups:
                group.provider.rollback(request.request_id, computed)
        request.num_computed_tokens = computed
        return tuple(s if s.token_id == t else dataclasses.replace(s, token_id=t) for s, t in zip(sampled, standing))

    def _append_token(
        self, request: Request, token_id: int, logprobs: TokenLogprobs | None, grammar_open: bool = True
    ) -> None:
        """`grammar_open`: False where the token completed the request's grammar."""
        request.token_ids.append(token_id)
        if logprobs is not None:
            request.logprobs.append(self.outputs.position_logprobs(logprobs))
            request.cumulative_logprob += logprobs.logprob
        new_text_len = 0
        if request.detokenizer is not None:
            new_text_len = len(request.detokenizer.push(token_id))
            request.text = request.detokenizer.text
        self._check_stop(request, token_id, new_text_len)
        if not grammar_open and request.status is not RequestStatus.FINISHED:
            request.finish("stop")  # the grammar is complete: nothing may follow

    def _check_stop(self, request: Request, token_id: int, new_text_len: int) -> None:
        params = request.params
        if request.num_output_tokens > params.min_tokens or params.min_tokens == 0:
            if not params.ignore_eos and token_id in self.parts.eos_token_ids:
                return request.finish("stop")
            if token_id in params.stop_token_ids:
                return request.finish("stop", token_id)
            if params.stop and new_text_len:
                match = find_stop_string(request.text, new_text_len, params.stop)
                if match is not None:
                    stop, index = match
                    cut = index + len(stop) if params.include_stop_str_in_output else index
                    request.text = request.text[:cut]
                    return request.finish("stop", stop)
        if request.num_output_tokens >= request.max_tokens:
            request.finish("length")

    # ---- finishing -------------------------------------------------------------------------

    def _retire(self, request: Request) -> RequestOutput:
        """Free everything a finished request holds and forget it."""
        if request in self._running:
            self._running.remove(request)
        if request in self._waiting:
            self._waiting.remove(request)
        if request.export_state and request.finish_reason == "length":  # computed to the end, not aborted
            request.exported = self._exports.export(request.request_id, request.num_computed_tokens)
        self._release_pages(request)
        self.parts.executor.release(request.request_id)
        if self.speculation is not None:
            self.speculation.release(request.request_id)
        self._grammar_open.pop(request.request_id, None)
        if self.structured is not None:
            self.structured.remove(request.request_id)
        del self._requests[request.request_id]
        output = self._output(request)
        return dataclasses.replace(output, kv_state=request.exported) if request.exported else output

    def _output(self, request: Request) -> RequestOutput:
        return self.outputs.output(request)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any; the engine cannot run steps afterwards."""
        self.parts.executor.shutdown()
        if self.structured is not None:
            self.structured.grammars.shutdown()

    def stats(self) -> EngineStats:
        kv = self.parts.kv
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_pages=kv.num_free_pages,
            num_used_pages=kv.num_used_pages,
            num_cached_pages=kv.num_cached_pages,
            num_total_pages=kv.total_capacity(),
            num_used_state_slots=self.parts.recurrent.num_used_slots if self.parts.recurrent else 0,
            num_total_state_slots=self.parts.recurrent.num_slots if self.parts.recurrent else 0,
            prefix_cache_queries=self._prefix.queried_tokens,
            prefix_cache_hits=self._prefix.hit_tokens,
            num_preemptions=self.num_preemptions,
            **self._host_tier_stats(),
            **self._structured_stats(),
            **self._speculation_stats(),
        )

    def _host_tier_stats(self) -> dict[str, int]:
        tier = self.parts.kv.host_tier
        if tier is None:
            return {}
        return dict(
            kv_offload_hit_tokens=self._prefix.host_hit_tokens,
            kv_offload_stored_bytes=tier.counters.stored_pages * tier.bytes_per_page,
            kv_offload_loaded_bytes=tier.counters.loaded_pages * tier.bytes_per_page,
        )

    def _structured_stats(self) -> dict[str, int | float]:
        structured = self.structured
        if structured is None:
            return {}
        return dict(
            structured_requests=structured.num_requests,
            grammars_compiled=structured.grammars.num_compiled,
            grammar_compile_seconds=structured.grammars.compile_seconds,
            grammar_mask_steps=structured.num_mask_steps,
            grammar_mask_seconds=structured.mask_seconds,
        )

    def _speculation_stats(self) -> dict[str, int]:
        if self.speculation is None:
            return {}
        stats: SpeculationStats = self.speculation.stats
        return dict(
            spec_decode_num_drafts=stats.num_drafts,
            spec_decode_num_draft_tokens=stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=stats.num_accepted_tokens,
        )
