"""The runner: executes one step's work. It turns plain data into tensors, binds attention
metadata, runs the model and samples; everything else belongs to the engine and planner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from kestrel.core.batch import KV_GROUP, BatchInputs, BatchLayout, SequenceChunk, values_to_device
from kestrel.core.decode_graphs import DecodeGraphs
from kestrel.core.forward import bind_groups
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.runtime import DeviceRuntime
from kestrel.core.runtime.base import HostTransfer
from kestrel.core.sampling import (
    DeviceSamples,
    LogprobTensors,
    RowMasks,
    SampledToken,
    Sampler,
    SamplingRow,
    TokenLogprobs,
    TokenMasks,
)
from kestrel.core.state import StateGroup
from kestrel.core.workspace import Workspace
from kestrel.sampling_params import SamplingParams


@dataclass(frozen=True)
class SequenceWork:
    """One request's share of a step, resolved by the engine from a `ScheduledChunk`."""

    request_id: str
    token_ids: tuple[int, ...]  # the new tokens whose state this step computes
    num_cached_tokens: int
    page_ids: tuple[int, ...]  # its pages in the KV group
    # Samples to draw, from the chunk's last rows: 0 (a prompt chunk that does not reach the
    # end), 1 (the next token), or k + 1 for a verify row (k draft tokens, each checked, and
    # the token after the last).
    num_samples: int
    params: SamplingParams
    seed: int  # seeds the request's generator the first time it samples
    prompt_token_ids: Sequence[int] = ()  # for penalties only
    output_token_ids: Sequence[int] = ()
    # Where prompt logprobs are wanted: the token that follows each of the first positions.
    prompt_logprob_targets: tuple[int, ...] = ()
    # What the request holds in every other state group (a recurrent state slot, ...).
    state_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # The chunk's last token is the one this request sampled in the previous step, still on
    # the device when this step was planned (overlapped scheduling): `token_ids` holds a
    # placeholder there, and the runner takes the token from its last samples.
    follows_last_sample: bool = False

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1

    def chunk(self) -> SequenceChunk:
        return SequenceChunk(len(self.token_ids), self.num_cached_tokens, self.page_ids, self.state_ids)


@dataclass(frozen=True)
class SequenceResult:
    request_id: str
    sampled: tuple[SampledToken, ...]  # `num_samples` of them, in row order
    prompt_logprobs: tuple[TokenLogprobs, ...]
    hidden_states: HiddenStates | None = None  # with the runner's `keep_hidden_states`


@dataclass(frozen=True)
class HiddenStates:
    """The final hidden state of each of a chunk's positions, on the device (an MTP draft's
    input)."""

    first_position: int  # the chunk's first position (its `num_cached_tokens`)
    states: torch.Tensor  # [positions, hidden]


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
        hidden: torch.Tensor | None = None,  # every row's final hidden state, kept for the results
    ) -> None:
        self._ordered, self._sampled_ids, self._samples = ordered, sampled_ids, samples
        self._prompt, self._transfer, self._hidden = prompt, transfer, hidden

    def result(self) -> StepOutput:
        if self._transfer is None:  # a rank that leaves sampling to rank 0
            return StepOutput(())
        host = self._transfer.wait()
        sampled: dict[str, list[SampledToken]] = {}
        if self._samples is not None:
            count = len(self._samples.tensors())
            for request_id, token in zip(self._sampled_ids, self._samples.package(host[:count])):
                sampled.setdefault(request_id, []).append(token)
            host = host[count:]
        prompt = {}
        for entry in self._prompt:
            count = len(entry.details.tensors())
            parts, host = host[:count], host[count:]
            prompt[entry.request_id] = tuple(LogprobTensors.package(parts, [entry.count] * len(parts[0])))
        rows = self._hidden_rows()
        return StepOutput(
            tuple(
                SequenceResult(
                    item.request_id, tuple(sampled.get(item.request_id, ())), prompt.get(item.request_id, ()), hidden
                )
                for item, hidden in zip(self._ordered, rows)
            )
        )

    def _hidden_rows(self) -> list[HiddenStates | None]:
        if self._hidden is None:
            return [None] * len(self._ordered)
        rows, start = [], 0
        for item in self._ordered:
            rows.append(HiddenStates(item.num_cached_tokens, self._hidden[start : start + len(item.token_ids)]))
            start += len(item.token_ids)
        return rows


@dataclass(frozen=True)
class _LogitRows:
    """Which logits rows belong to one sequence."""

    prompt_rows: range
    sample_rows: range


class ModelRunner:
    """Runs steps. It holds no request's state: what a request keeps between steps lives in
    the state providers (its pages and slots) and the sampler (its generator, its last
    sample)."""

    def __init__(
        self,
        model: nn.Module,
        groups: Mapping[str, StateGroup],
        runtime: DeviceRuntime,
        workspace: Workspace,
        max_num_batched_tokens: int,
        graphs: DecodeGraphs | None = None,
        samples: bool = True,  # tensor-parallel workers compute logits but leave sampling to rank 0
        parallel: TensorParallel = SINGLE,
    ) -> None:
        # Whether results carry every position's final hidden state (an MTP draft's input).
        self.keep_hidden_states = False
        if KV_GROUP not in groups:
            raise ValueError(f"a runner needs the {KV_GROUP!r} state group; got {sorted(groups)}")
        self.samples = samples
        self.parallel = parallel
        self.model = model
        self.groups = groups
        self.graphs = graphs
        self.runtime = runtime
        self.page_size = groups[KV_GROUP].provider.spec.page_size
        self.sampler = Sampler()
        self.workspace = workspace
        for name in ("input_ids", "positions"):
            workspace.reserve(name, max_num_batched_tokens, torch.long)

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        self.sampler.forget(request_id)

    def execute(self, work: Sequence[SequenceWork], masks: TokenMasks | None = None) -> StepOutput:
        """Run one step and wait for its results."""
        return self.launch(work, masks).result()

    @torch.inference_mode()
    def launch(self, work: Sequence[SequenceWork], masks: TokenMasks | None = None) -> LaunchedStep:
        """Queue one step on the device (forward, sampling, the copy of the samples to the
        host) and return without waiting for it. `masks` restrict constrained requests'
        samples; they are filled after the forward pass is queued, while the device runs it."""
        ordered = sorted(work, key=lambda item: not item.is_decode)  # stable: decodes first
        in_graph = self._fits_graph(ordered)
        layout = self._layout(ordered, as_decode_rows=in_graph)
        token_ids, logits_indices, rows = self._host_inputs(ordered)
        follows = self._follow_rows(ordered)
        if follows:
            self.sampler.share_last(self.parallel, self.runtime.device)
        if in_graph:
            logits = self.graphs.run(layout, token_ids, lambda ids: self._take_last_samples(ids, follows))
            if len(logits_indices) < len(token_ids):  # rows computed again, not sampled (`_is_graph_row`)
                logits = logits[values_to_device(logits_indices, torch.long, logits.device)]
            hidden = self.graphs.last_hidden_states() if self.keep_hidden_states else None
        else:
            hidden, logits = self._run_eager(layout, token_ids, logits_indices, follows)
        # A copy: graph memory is overwritten by the next replay.
        hidden = hidden[: len(token_ids)].clone() if self.keep_hidden_states else None
        if not self.samples:
            self.sampler.remember([item.request_id for item, r in zip(ordered, rows) for _ in r.sample_rows], None)
            return LaunchedStep(ordered, [], None, [], None)
        sampled_ids, samples = self._sample(ordered, rows, logits, masks)
        self.sampler.remember(sampled_ids, samples.tokens if samples is not None else None)
        prompt = self._prompt_logprobs(ordered, rows, logits)
        tensors = (samples.tensors() if samples is not None else []) + [
            t for entry in prompt for t in entry.details.tensors()
        ]
        return LaunchedStep(ordered, sampled_ids, samples, prompt, self.runtime.to_host_async(tensors), hidden)

    def _follow_rows(self, ordered: list[SequenceWork]) -> list[tuple[int, int]]:
        """(input position, row of the last samples) for each chunk whose last token is still
        on the device."""
        follows, end = [], 0
        last = self.sampler.last
        for item in ordered:
            end += len(item.token_ids)
            if item.follows_last_sample:
                if last is None or item.request_id not in last.rows:
                    raise RuntimeError(f"request {item.request_id} follows a sample the last step did not draw")
                follows.append((end - 1, last.rows[item.request_id]))
        return follows

    def _take_last_samples(self, input_ids: torch.Tensor, follows: list[tuple[int, int]]) -> None:
        """Write the previous step's samples into this step's input ids, on the device."""
        if not follows:
            return
        positions, rows = zip(*follows)
        device = input_ids.device
        input_ids[values_to_device(positions, torch.long, device)] = self.sampler.last.tokens[
            values_to_device(rows, torch.long, device)
        ]

    def _layout(self, ordered: list[SequenceWork], as_decode_rows: bool = False) -> BatchLayout:
        """The step's sequences; with `as_decode_rows`, a chunk of q tokens (a verify chunk,
        say) is laid out as q one-token rows of the same sequence, row j seeing j more tokens:
        each row writes its token's keys and values before any row attends, so the rows
        compute what the chunk would, through the decode path (and its captured graphs)."""
        chunks = []
        for item in ordered:
            chunk = item.chunk()
            if as_decode_rows and chunk.query_len > 1:
                first = chunk.num_cached_tokens
                chunks.extend(
                    SequenceChunk(1, first + row, chunk.page_ids, chunk.state_ids) for row in range(chunk.query_len)
                )
            else:
                chunks.append(chunk)
        num_decodes = sum(1 for chunk in chunks if chunk.query_len == 1)
        return BatchLayout(tuple(chunks), num_decodes, self.page_size)

    def _fits_graph(self, ordered: list[SequenceWork]) -> bool:
        """Captured graphs cover steps of one-token rows: decodes, and the chunks
        `_is_graph_row` takes, laid out as rows of their own, where every state group's binder lets
        a sequence's rows see each other (paged KV: each row stores its keys before any row
        attends; recurrent state: the rows are folded in one after another)."""
        if self.graphs is None:
            return False
        rows = sum(len(item.token_ids) for item in ordered)
        if self.graphs.bucket_for(rows) is None or any(item.prompt_logprob_targets for item in ordered):
            return False
        if not self.graphs.verify_rows and not all(item.is_decode for item in ordered):
            return False
        return all(self._is_graph_row(item) for item in ordered)

    def _is_graph_row(self, item: SequenceWork) -> bool:
        """A decode, or a chunk laid out as rows of its own: a verify chunk (behind any
        accepted drafts computed again after a recurrent state rolled back), or the two tokens
        computed again after a verify whose drafts all failed (the one before them and the
        correction). Each row reads its sequence's whole context, so a longer chunk that
        samples once (a prompt's last chunk) runs eagerly, through the prefill path."""
        if item.is_decode:
            return item.num_samples == 1
        return item.num_samples > 1 or (item.num_samples == 1 and len(item.token_ids) <= 2)

    def _run_eager(
        self, layout: BatchLayout, token_ids: list[int], logits_indices: list[int], follows: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of every row, and the logits of the rows asked for."""
        inputs = BatchInputs(
            input_ids=self._stage("input_ids", token_ids),
            positions=self._stage("positions", layout.positions.tolist()),
            logits_indices=values_to_device(logits_indices, torch.long, self.runtime.device),
        )
        self._take_last_samples(inputs.input_ids, follows)
        context = bind_groups(self.groups, lambda binder: binder.bind(layout))
        hidden = self.model(inputs.input_ids, inputs.positions, context)
        return hidden, self.model.compute_logits(hidden[inputs.logits_indices])

    def _host_inputs(self, ordered: list[SequenceWork]) -> tuple[list[int], list[int], list[_LogitRows]]:
        """Token ids, the rows whose logits are needed, and which of those rows are whose."""
        token_ids: list[int] = []
        logits_indices: list[int] = []
        rows: list[_LogitRows] = []
        for item in ordered:
            start = len(token_ids)
            token_ids.extend(item.token_ids)
            first_row = len(logits_indices)
            logits_indices.extend(range(start, start + len(item.prompt_logprob_targets)))
            prompt_rows = range(first_row, len(logits_indices))
            logits_indices.extend(range(len(token_ids) - item.num_samples, len(token_ids)))
            rows.append(_LogitRows(prompt_rows, range(prompt_rows.stop, len(logits_indices))))
        return token_ids, logits_indices, rows

    def _stage(self, name: str, values: list[int]) -> torch.Tensor:
        buffer = self.workspace.get(name, (len(values),), torch.long)
        buffer.copy_(values_to_device(values, torch.long, buffer.device))
        return buffer

    def _sample(
        self, ordered: list[SequenceWork], rows: list[_LogitRows], logits: torch.Tensor, masks: TokenMasks | None
    ) -> tuple[list[str], DeviceSamples | None]:
        sampled_ids, sampling_rows, row_ids = [], [], []
        for item, r in zip(ordered, rows):
            generator = self.sampler.generator(item.request_id, item.seed) if r.sample_rows else None
            drafts = item.token_ids[len(item.token_ids) - item.num_samples + 1 :]
            for draft_index, row in enumerate(r.sample_rows):
                # A verify row's later samples follow its draft tokens: penalties count them.
                outputs = item.output_token_ids
                if draft_index and outputs:
                    outputs = tuple(outputs) + drafts[:draft_index]
                sampling_rows.append(SamplingRow(item.params, generator, item.prompt_token_ids, outputs))
                sampled_ids.append(item.request_id)
                row_ids.append(row)
        if not row_ids:
            return [], None
        if row_ids != list(range(logits.shape[0])):  # a copy of the logits only when rows are skipped
            logits = logits[values_to_device(row_ids, torch.long, logits.device)]
        return sampled_ids, self.sampler.sample_on_device(logits, sampling_rows, _row_masks(sampled_ids, masks))

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


def _row_masks(sampled_ids: list[str], masks: TokenMasks | None) -> RowMasks | None:
    """The bitmasks of the rows whose requests are constrained (a verify chunk's rows in order:
    the masks' owner fills each after the drafts before it)."""
    if masks is None:
        return None
    rows = [row for row, request_id in enumerate(sampled_ids) if masks.constrained(request_id)]
    if not rows:
        return None
    return RowMasks(tuple(rows), masks.fill([sampled_ids[row] for row in rows]))
