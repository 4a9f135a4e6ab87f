"""The runner: executes one step's work. It turns plain data into tensors, binds attention
metadata, runs the model and samples; everything else belongs to the engine and planner."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kestrel.core.attention.base import AttentionBackend
from kestrel.core.batch import BatchInputs, BatchLayout, SequenceChunk, query_start_loc, values_to_device
from kestrel.core.cuda_graphs import DecodeGraphs
from kestrel.core.forward import ForwardContext
from kestrel.core.metadata import RecurrentMetadata
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.runtime import DeviceRuntime
from kestrel.core.runtime.base import HostTransfer
from kestrel.core.sampling import DeviceSamples, LogprobTensors, SampledToken, Sampler, SamplingRow, TokenLogprobs
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
    # The chunk's last token is the one this request sampled in the previous step, still on
    # the device when this step was planned (overlapped scheduling): `token_ids` holds a
    # placeholder there, and the runner takes the token from its last samples.
    follows_last_sample: bool = False

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


class PendingStep(Protocol):
    """A step handed to an executor; `result()` blocks until its results are on the host."""

    def result(self) -> StepOutput: ...


@dataclass(frozen=True)
class _PromptLogprobs:
    request_id: str
    count: int
    details: LogprobTensors


class LaunchedStep:
    """A step queued on the device; `result()` waits for its samples and reads them."""

    def __init__(
        self,
        ordered: list[SequenceWork],
        sampled_ids: list[str],
        samples: DeviceSamples | None,
        prompt: list[_PromptLogprobs],
        transfer: HostTransfer | None,
    ) -> None:
        self._ordered, self._sampled_ids, self._samples = ordered, sampled_ids, samples
        self._prompt, self._transfer = prompt, transfer

    def result(self) -> StepOutput:
        if self._transfer is None:  # a rank that leaves sampling to rank 0
            return StepOutput(())
        host = self._transfer.wait()
        sampled = {}
        if self._samples is not None:
            count = len(self._samples.tensors())
            sampled = dict(zip(self._sampled_ids, self._samples.package(host[:count])))
            host = host[count:]
        prompt = {}
        for entry in self._prompt:
            count = len(entry.details.tensors())
            parts, host = host[:count], host[count:]
            prompt[entry.request_id] = tuple(LogprobTensors.package(parts, [entry.count] * len(parts[0])))
        return StepOutput(
            tuple(
                SequenceResult(item.request_id, sampled.get(item.request_id), prompt.get(item.request_id, ()))
                for item in self._ordered
            )
        )


@dataclass(frozen=True)
class _LastSamples:
    """The previous step's sampled tokens on the device, and which row is whose."""

    rows: dict[str, int]
    tokens: torch.Tensor | None  # None on a tensor-parallel worker until rank 0 shares them


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
        parallel: TensorParallel = SINGLE,
    ) -> None:
        self.samples = samples
        self.parallel = parallel
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
        self._last: _LastSamples | None = None  # the samples of the step launched last

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

    def execute(self, work: Sequence[SequenceWork]) -> StepOutput:
        """Run one step and wait for its results."""
        return self.launch(work).result()

    @torch.inference_mode()
    def launch(self, work: Sequence[SequenceWork]) -> LaunchedStep:
        """Queue one step on the device (forward, sampling, the copy of the samples to the
        host) and return without waiting for it."""
        ordered = sorted(work, key=lambda item: not item.is_decode)  # stable: decodes first
        layout = self._layout(ordered)
        token_ids, positions, logits_indices, rows = self._host_inputs(ordered)
        follows = self._follow_rows(ordered)
        if follows:
            self._share_last_samples()
        if self._fits_graph(ordered):
            logits = self.graphs.run(layout, token_ids, positions, lambda ids: self._take_last_samples(ids, follows))
        else:
            logits = self._run_eager(layout, ordered, token_ids, positions, logits_indices, follows)
        if not self.samples:
            self._remember_samples(
                [item.request_id for item, r in zip(ordered, rows) if r.sample_row is not None], None
            )
            return LaunchedStep(ordered, [], None, [], None)
        sampled_ids, samples = self._sample(ordered, rows, logits)
        self._remember_samples(sampled_ids, samples.tokens if samples is not None else None)
        prompt = self._prompt_logprobs(ordered, rows, logits)
        tensors = (samples.tensors() if samples is not None else []) + [
            t for entry in prompt for t in entry.details.tensors()
        ]
        return LaunchedStep(ordered, sampled_ids, samples, prompt, self.runtime.to_host_async(tensors))

    def _follow_rows(self, ordered: list[SequenceWork]) -> list[tuple[int, int]]:
        """(input position, row of the last samples) for each chunk whose last token is still
        on the device."""
        follows, end = [], 0
        for item in ordered:
            end += len(item.token_ids)
            if item.follows_last_sample:
                if self._last is None or item.request_id not in self._last.rows:
                    raise RuntimeError(f"request {item.request_id} follows a sample the last step did not draw")
                follows.append((end - 1, self._last.rows[item.request_id]))
        return follows

    def _remember_samples(self, sampled_ids: list[str], tokens: torch.Tensor | None) -> None:
        """Keep this step's samples (on a worker, only whose rows they are) for the next step."""
        rows = {request_id: row for row, request_id in enumerate(sampled_ids)}
        self._last = _LastSamples(rows, tokens) if rows else None

    def _share_last_samples(self) -> None:
        """Every rank takes the tokens rank 0 sampled last step (only rank 0 samples); all ranks
        get here in the same steps, because they all run the same work."""
        if self.parallel.size == 1:
            return
        tokens = self._last.tokens
        if tokens is None:
            tokens = torch.empty(len(self._last.rows), dtype=torch.long, device=self.runtime.device)
            self._last = _LastSamples(self._last.rows, tokens)
        self.parallel.broadcast_from_first(tokens)

    def _take_last_samples(self, input_ids: torch.Tensor, follows: list[tuple[int, int]]) -> None:
        """Write the previous step's samples into this step's input ids, on the device."""
        if not follows:
            return
        positions, rows = zip(*follows)
        device = input_ids.device
        input_ids[values_to_device(positions, torch.long, device)] = self._last.tokens[
            values_to_device(rows, torch.long, device)
        ]

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
        follows: list[tuple[int, int]],
    ) -> torch.Tensor:
        inputs = BatchInputs(
            input_ids=self._stage("input_ids", token_ids),
            positions=self._stage("positions", positions),
            logits_indices=values_to_device(logits_indices, torch.long, self.runtime.device),
        )
        self._take_last_samples(inputs.input_ids, follows)
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
            slots=values_to_device(slot_ids, torch.long, device),
            has_state_tensor=values_to_device(has_state, torch.bool, device),
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
        buffer.copy_(values_to_device(values, torch.long, buffer.device))
        return buffer

    def _generator(self, item: SequenceWork) -> random.Random:
        generator = self._generators.get(item.request_id)
        if generator is None:
            generator = random.Random(item.seed)
            self._generators[item.request_id] = generator
        return generator

    def _sample(
        self, ordered: list[SequenceWork], rows: list[_LogitRows], logits: torch.Tensor
    ) -> tuple[list[str], DeviceSamples | None]:
        chosen = [(item, r.sample_row) for item, r in zip(ordered, rows) if r.sample_row is not None]
        if not chosen:
            return [], None
        sampling_rows = [
            SamplingRow(item.params, self._generator(item), item.prompt_token_ids, item.output_token_ids)
            for item, _ in chosen
        ]
        row_ids = [row for _, row in chosen]
        if row_ids != list(range(logits.shape[0])):  # a copy of the logits only when rows are skipped
            logits = logits[values_to_device(row_ids, torch.long, logits.device)]
        samples = self.sampler.sample_on_device(logits, sampling_rows)
        return [item.request_id for item, _ in chosen], samples

    def _prompt_logprobs(
        self, ordered: list[SequenceWork], rows: list[_LogitRows], logits: torch.Tensor
    ) -> list[_PromptLogprobs]:
        results = []
        for item, r in zip(ordered, rows):
            if not item.prompt_logprob_targets:
                continue
            logprobs = logits[r.prompt_rows.start : r.prompt_rows.stop].log_softmax(dim=-1)
            targets = values_to_device(item.prompt_logprob_targets, torch.long, logits.device)
            count = item.params.prompt_logprobs or 0
            results.append(_PromptLogprobs(item.request_id, count, LogprobTensors.of(logprobs, targets, count)))
        return results
