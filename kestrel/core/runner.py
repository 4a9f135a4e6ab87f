"""The runner: executes one step's work. It turns plain data into tensors, binds attention
metadata, runs the model and samples; everything else belongs to the engine and planner."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kestrel.core.attention.base import AttentionBackend
from kestrel.core.batch import BatchInputs, BatchLayout, SequenceChunk, query_start_loc
from kestrel.core.cuda_graphs import DecodeGraphs
from kestrel.core.forward import ForwardContext
from kestrel.core.metadata import RecurrentMetadata
from kestrel.core.runtime import DeviceRuntime
from kestrel.core.sampling import SampledToken, Sampler, SamplingRow, TokenLogprobs, top_logprobs
from kestrel.core.state import PagedKVProvider, RecurrentStateProvider
from kestrel.core.workspace import Workspace
from kestrel.sampling_params import SamplingParams

WARM_UP_SEQ_LEN = 1024  # throwaway prompts are at most this long: activations scale with tokens
WARM_UP_PREFIX = "warm-up-"  # the warm-up runs before any request exists, so ids cannot clash
WARM_UP_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True)
class SequenceWork:
    """One request's share of a step, resolved by the engine from a `ScheduledChunk`."""

    request_id: str
    token_ids: tuple[int, ...]  # the new tokens whose KV this step computes
    num_cached_tokens: int
    page_ids: tuple[int, ...]
    sample: bool  # the chunk reaches the end of the sequence: sample the next token
    params: SamplingParams
    seed: int  # seeds the request's generator the first time it samples
    prompt_token_ids: Sequence[int] = ()  # for penalties only
    output_token_ids: Sequence[int] = ()
    # Where prompt logprobs are wanted: the token that follows each of the first positions.
    prompt_logprob_targets: tuple[int, ...] = ()
    state_slot: int | None = None  # hybrid models: the request's recurrent state slot

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1


@dataclass(frozen=True)
class SequenceResult:
    request_id: str
    sampled: SampledToken | None
    prompt_logprobs: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class StepOutput:
    results: tuple[SequenceResult, ...]


@dataclass(frozen=True)
class _LogitRows:
    """Which logits rows belong to one sequence."""

    prompt_rows: range
    sample_row: int | None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv: PagedKVProvider,
        runtime: DeviceRuntime,
        max_num_batched_tokens: int,
        graphs: DecodeGraphs | None = None,
        recurrent: RecurrentStateProvider | None = None,
        samples: bool = True,  # tensor-parallel workers compute logits but leave sampling to rank 0
    ) -> None:
        self.samples = samples
        self.model = model
        self.recurrent = recurrent
        self.graphs = graphs
        self.backend = backend
        self.kv = kv
        self.runtime = runtime
        self.sampler = Sampler()
        self.workspace = Workspace(runtime.device)
        for name in ("input_ids", "positions"):
            self.workspace.reserve(name, max_num_batched_tokens, torch.long)
        backend.allocate(self.workspace)
        self._generators: dict[str, random.Random] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        self._generators.pop(request_id, None)

    def warm_up(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> None:
        """Run the largest steps the planner may send (a full prefill budget, then a full decode
        batch) on throwaway sequences, as far as the KV pool holds them.

        This is the profiling forward: it sets the peak activation memory the KV budget must
        leave room for, compiles kernels and settles the allocators, so the first real
        requests do not pay for any of that.
        """
        seq_len = max(1, min(max_seq_len, WARM_UP_SEQ_LEN, num_tokens))
        prefills = [seq_len] * min(num_tokens // seq_len, num_seqs)
        decodes = [1] * min(num_seqs, num_tokens)  # every step keeps to the token budget
        for step in (prefills, decodes):
            room = self.kv.free_capacity()
            fitting = []
            for length in step:
                room -= self.kv.allocator.pages_needed(length)
                if room < 0:
                    break
                fitting.append(length)
            if fitting:
                self._throwaway_step(fitting)

    def _throwaway_step(self, lengths: list[int]) -> None:
        ids = [f"{WARM_UP_PREFIX}{index}" for index in range(len(lengths))]
        try:
            work = [
                SequenceWork(
                    request_id=request_id,
                    token_ids=(0,) * length,
                    num_cached_tokens=0,
                    page_ids=tuple(self.kv.reserve(request_id, length)),
                    sample=True,
                    params=WARM_UP_PARAMS,
                    seed=0,
                    state_slot=self.recurrent.reserve(request_id, length)[0] if self.recurrent else None,
                )
                for request_id, length in zip(ids, lengths)
            ]
            self.execute(work)
        finally:
            for request_id in ids:
                self.kv.release(request_id)
                if self.recurrent is not None:
                    self.recurrent.release(request_id)
                self.release(request_id)

    @torch.inference_mode()
    def execute(self, work: Sequence[SequenceWork]) -> StepOutput:
        ordered = sorted(work, key=lambda item: not item.is_decode)  # stable: decodes first
        layout = self._layout(ordered)
        token_ids, positions, logits_indices, rows = self._host_inputs(ordered)
        if self._fits_graph(ordered):
            logits = self.graphs.run(layout, token_ids, positions)
        else:
            logits = self._run_eager(layout, ordered, token_ids, positions, logits_indices)
        if not self.samples:
            return StepOutput(())
        sampled = self._sample(ordered, rows, logits)
        prompt = self._prompt_logprobs(ordered, rows, logits)
        results = tuple(
            SequenceResult(item.request_id, sampled.get(item.request_id), prompt.get(item.request_id, ()))
            for item in ordered
        )
        return StepOutput(results)

    def _layout(self, ordered: list[SequenceWork]) -> BatchLayout:
        chunks = tuple(SequenceChunk(len(item.token_ids), item.num_cached_tokens, item.page_ids) for item in ordered)
        num_decodes = sum(1 for item in ordered if item.is_decode)
        return BatchLayout(chunks=chunks, num_decodes=num_decodes, page_size=self.kv.spec.page_size)

    def _fits_graph(self, ordered: list[SequenceWork]) -> bool:
        """Captured graphs cover decode-only steps that sample every row and nothing else."""
        if self.graphs is None or self.graphs.bucket_for(len(ordered)) is None:
            return False
        return all(item.is_decode and item.sample and not item.prompt_logprob_targets for item in ordered)

    def _run_eager(
        self,
        layout: BatchLayout,
        ordered: list[SequenceWork],
        token_ids: list[int],
        positions: list[int],
        logits_indices: list[int],
    ) -> torch.Tensor:
        inputs = BatchInputs(
            input_ids=self._stage("input_ids", token_ids),
            positions=self._stage("positions", positions),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.runtime.device),
        )
        context = ForwardContext(
            self.backend, self.backend.bind(layout), self.kv, self.recurrent, self._bind_recurrent(layout, ordered)
        )
        hidden = self.model(inputs.input_ids, inputs.positions, context)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _bind_recurrent(self, layout: BatchLayout, ordered: list[SequenceWork]) -> RecurrentMetadata | None:
        if self.recurrent is None:
            return None
        slot_ids = tuple(item.state_slot for item in ordered)
        has_state = tuple(item.num_cached_tokens > 0 for item in ordered)
        device = self.runtime.device
        return RecurrentMetadata(
            num_decodes=layout.num_decodes,
            query_start_loc=tuple(query_start_loc(layout.chunks)),
            slot_ids=slot_ids,
            has_state=has_state,
            slots=torch.tensor(slot_ids, dtype=torch.long, device=device),
            has_state_tensor=torch.tensor(has_state, dtype=torch.bool, device=device),
        )

    def _host_inputs(self, ordered: list[SequenceWork]) -> tuple[list[int], list[int], list[int], list[_LogitRows]]:
        """Token ids, positions, the rows whose logits are needed, and which rows are whose."""
        token_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        rows: list[_LogitRows] = []
        for item in ordered:
            start = len(token_ids)
            token_ids.extend(item.token_ids)
            positions.extend(range(item.num_cached_tokens, item.num_cached_tokens + len(item.token_ids)))
            first_row = len(logits_indices)
            logits_indices.extend(range(start, start + len(item.prompt_logprob_targets)))
            sample_row = None
            if item.sample:
                sample_row = len(logits_indices)
                logits_indices.append(len(token_ids) - 1)
            rows.append(_LogitRows(range(first_row, first_row + len(item.prompt_logprob_targets)), sample_row))
        return token_ids, positions, logits_indices, rows

    def _stage(self, name: str, values: list[int]) -> torch.Tensor:
        buffer = self.workspace.get(name, (len(values),), torch.long)
        buffer.copy_(torch.tensor(values, dtype=torch.long))
        return buffer

    def _generator(self, item: SequenceWork) -> random.Random:
        generator = self._generators.get(item.request_id)
        if generator is None:
            generator = random.Random(item.seed)
            self._generators[item.request_id] = generator
        return generator

    def _sample(
        self, ordered: list[SequenceWork], rows: list[_LogitRows], logits: torch.Tensor
    ) -> dict[str, SampledToken]:
        chosen = [(item, r.sample_row) for item, r in zip(ordered, rows) if r.sample_row is not None]
        if not chosen:
            return {}
        sampling_rows = [
            SamplingRow(item.params, self._generator(item), item.prompt_token_ids, item.output_token_ids)
            for item, _ in chosen
        ]
        row_ids = [row for _, row in chosen]
        if row_ids != list(range(logits.shape[0])):  # a copy of the logits only when rows are skipped
            logits = logits[torch.tensor(row_ids, dtype=torch.long, device=logits.device)]
        tokens = self.sampler.sample(logits, sampling_rows)
        return {item.request_id: token for (item, _), token in zip(chosen, tokens)}

    def _prompt_logprobs(
        self, ordered: list[SequenceWork], rows: list[_LogitRows], logits: torch.Tensor
    ) -> dict[str, tuple[TokenLogprobs, ...]]:
        results = {}
        for item, r in zip(ordered, rows):
            if not item.prompt_logprob_targets:
                continue
            logprobs = logits[r.prompt_rows.start : r.prompt_rows.stop].log_softmax(dim=-1)
            targets = torch.tensor(item.prompt_logprob_targets, dtype=torch.long, device=logits.device)
            count = item.params.prompt_logprobs or 0
            results[item.request_id] = tuple(top_logprobs(logprobs, targets, [count] * len(targets)))
        return results
