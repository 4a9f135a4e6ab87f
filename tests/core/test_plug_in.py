"""Plugging new parts in through the contracts alone.

A fake attention backend (uniform attention: each token averages the values it may see), a
fake state provider with a layer kind of its own (a running sum per sequence, in a state group
"counter") and a fake model over them are written here, in the tests only. They run a
multi-token verify step, roll rejected tokens back, replay decode steps through the graph
hooks, and export and import a request's state, with zero edits to `core/planner.py` and
`core/runner.py`: the runner, the workspace, the graph module and the transfer are Kestrel's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from kestrel.core.attention.base import AttentionLayerSpec, BackendCapabilities
from kestrel.core.attention.paged import PagedAttentionBackend
from kestrel.core.attention.torch_ref import gather_pages, store_kv
from kestrel.core.batch import KV_GROUP, BatchLayout, to_device
from kestrel.core.binder import StepBinder
from kestrel.core.decode_graphs import DecodeGraphs, decode_buckets
from kestrel.core.forward import BoundGroup, ForwardContext, bind_groups
from kestrel.core.layer_spec import LayerSpec, PoolBudget
from kestrel.core.recipe import ModelSpec
from kestrel.core.runner import ModelRunner, SequenceWork
from kestrel.core.runtime import create_runtime
from kestrel.core.state import KVCacheSpec, OutOfPagesError, PagedKVProvider, StateGroup, StateProvider
from kestrel.core.transfer import StateCopy
from kestrel.core.workspace import Workspace
from kestrel.sampling_params import SamplingParams

DIM, HEADS, HEAD_DIM, VOCAB, PAGE = 16, 2, 8, 32, 4
COUNTER = "counter"
GREEDY = SamplingParams(temperature=0.0)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class UniformAttentionBackend(PagedAttentionBackend):
    """Each token's output is the mean of the values at positions up to its own."""

    name = "uniform"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32}),
        head_dims=None,
        sliding_window=False,
        cuda_graphs=True,
        page_sizes=None,
    )

    def store(self, cache, key, value, slots) -> None:
        store_kv(cache, key, value, slots)

    def decode(self, query, key, value, cache, meta, layer, output) -> None:
        values = gather_pages(cache.value, meta.page_table)  # [rows, heads, width, dim]
        seen = torch.arange(values.shape[2], device=values.device)[None, :] < meta.seq_lens[:, None]
        total = (values * seen[:, None, :, None]).sum(dim=2)
        output[: meta.num_seqs] = total / meta.seq_lens[:, None, None]

    def prefill(self, query, key, value, cache, meta, layer, output) -> None:
        values = gather_pages(cache.value, meta.page_table).cumsum(dim=2)
        for row, (start, end) in enumerate(zip(meta.query_start_loc, meta.query_start_loc[1:])):
            positions = torch.arange(meta.num_cached_tokens[row], meta.seq_lens[row], device=values.device)
            output[start:end] = (values[row][:, positions] / (positions + 1)[None, :, None]).transpose(0, 1)


@dataclass(frozen=True)
class CounterMetadata:
    slots: torch.Tensor  # [rows], one row per sequence (decode) or per token (prefill)
    fresh: torch.Tensor  # [rows] bool: the sequence starts from zero state
    per_token: tuple[tuple[int, bool], ...]  # (slot, fresh) of every token row, eager steps only


class CounterProvider(StateProvider, StepBinder):
    """One vector per sequence: the running sum of its hidden states. Its own binder."""

    supports_graphs = True

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device, self.scratch_id = device, num_slots
        self.sums = torch.zeros((num_slots + 1, DIM), device=device)
        self._free = list(range(num_slots))
        self._owned: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def reserve(self, request_id, num_tokens):
        if request_id not in self._owned:
            if not self._free:
                raise OutOfPagesError("no counter slot left")
            self._owned[request_id] = self._free.pop()
        self._tokens[request_id] = num_tokens
        return [self._owned[request_id]]

    def release(self, request_id):
        self._tokens.pop(request_id, None)
        if request_id in self._owned:
            self._free.append(self._owned.pop(request_id))

    def free_capacity(self):
        return len(self._free)

    def total_capacity(self):
        return self.scratch_id

    def held_by(self, request_id):
        return [self._owned[request_id]] if request_id in self._owned else []

    def rollback(self, request_id, num_tokens):
        return num_tokens if num_tokens >= self._tokens.get(request_id, 0) else 0  # a sum cannot step back

    def export(self, request_id, place):
        return [self.sums[self._owned[request_id]].to(place)]

    def import_state(self, request_id, num_tokens, state):
        (slot,) = self.reserve(request_id, num_tokens)
        self.sums[slot] = state[0].to(self.device)
        return [slot]

    def layer(self, index):
        return self.sums

    def bind(self, layout: BatchLayout) -> CounterMetadata:
        per_token = tuple(
            (chunk.ids_in(COUNTER)[0], chunk.num_cached_tokens == 0 and offset == 0)
            for chunk in layout.chunks
            for offset in range(chunk.query_len)
        )
        slots, fresh = zip(*per_token)
        return CounterMetadata(
            to_device(np.array(slots), self.device), torch.tensor(fresh, device=self.device), per_token
        )

    def prepare_capture(self, workspace, provider, max_rows, max_pages) -> None:
        workspace.reserve("counter.slots_and_fresh", 2 * max_rows, torch.long)
        self._graph = workspace.get("counter.slots_and_fresh", (2, max_rows), torch.long)
        self._graph[0].fill_(provider.scratch_id)

    def capture_metadata(self, num_rows) -> CounterMetadata:
        return CounterMetadata(self._graph[0, :num_rows], self._graph[1, :num_rows] != 0, ())

    def prepare_replay(self, layout, num_rows) -> None:
        vectors = np.zeros((2, num_rows), dtype=np.int64)
        vectors[0] = self.scratch_id
        vectors[0, : len(layout.chunks)] = [chunk.ids_in(COUNTER)[0] for chunk in layout.chunks]
        vectors[1, : len(layout.chunks)] = layout.num_cached == 0
        self._graph[:, :num_rows].copy_(to_device(vectors, self.device))


@dataclass(frozen=True)
class CounterLayer(LayerSpec):
    """The new layer kind: its state lives in the "counter" group, one slot per sequence."""

    state_group: str = COUNTER

    def group_spec(self, num_layers, dtype, kv_dtype, page_size, parallel):
        return CounterGroup()


@dataclass(frozen=True)
class CounterGroup:
    paged = False

    def bytes_per_unit(self) -> int:
        return DIM * 4

    def build(self, budget: PoolBudget) -> CounterProvider:
        return CounterProvider(budget.max_num_seqs, budget.device)


class FakeModel(nn.Module):
    """Embedding -> uniform attention -> running sum -> LM head."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, DIM, generator=generator), requires_grad=False)
        self.qkv = nn.Parameter(torch.randn(DIM, 3 * DIM, generator=generator) / 4, requires_grad=False)
        self.head = nn.Parameter(torch.randn(VOCAB, DIM, generator=generator), requires_grad=False)
        self.layer = AttentionLayerSpec(HEADS, HEADS, HEAD_DIM, HEAD_DIM**-0.5)

    def forward(self, input_ids, positions, context: ForwardContext) -> torch.Tensor:
        hidden = self.embed[input_ids]
        query, key, value = (part.reshape(-1, HEADS, HEAD_DIM) for part in (hidden @ self.qkv).chunk(3, dim=-1))
        hidden = hidden + context.attend(0, query, key, value, self.layer).reshape(-1, DIM)
        return hidden + 0.1 * self._count(hidden, context.bound(COUNTER))

    def _count(self, hidden: torch.Tensor, bound: BoundGroup) -> torch.Tensor:
        sums, meta = bound.group.provider.layer(0), bound.metadata
        if not meta.per_token:  # a replayed decode step: one row per sequence, on the device
            prior = torch.where(meta.fresh[:, None], torch.zeros_like(sums[meta.slots]), sums[meta.slots])
            sums[meta.slots] = prior + hidden
            return sums[meta.slots]
        out = torch.empty_like(hidden)
        for row, (slot, fresh) in enumerate(meta.per_token):
            sums[slot] = (0 if fresh else sums[slot]) + hidden[row]
            out[row] = sums[slot]
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head.T).float()


SPEC = ModelSpec("Fake", VOCAB, DIM, 2, 256, False, layers=(CounterLayer(), CounterLayer()))


def build_runner(device: str, graphs: bool = False) -> ModelRunner:
    runtime = create_runtime(device)
    model = FakeModel().to(runtime.device)
    kv = PagedKVProvider(
        KVCacheSpec(1, HEADS, HEAD_DIM, torch.float32, PAGE), 64 * 2 * HEADS * HEAD_DIM * 4 * PAGE, runtime.device
    )
    counter_spec = SPEC.state_groups(torch.float32, torch.float32, PAGE)[COUNTER]
    counter = counter_spec.build(PoolBudget(0, 4, runtime.device))
    groups = {
        KV_GROUP: StateGroup(KV_GROUP, kv, UniformAttentionBackend(runtime.device, PAGE)),
        COUNTER: StateGroup(COUNTER, counter, counter),
    }
    workspace = Workspace(runtime.device)
    decode_graphs = None
    if graphs:
        decode_graphs = DecodeGraphs(model, groups, workspace, runtime, decode_buckets(4), max_pages_per_seq=16)
        decode_graphs.capture()
    return ModelRunner(model, groups, runtime, workspace, 64, decode_graphs)


def work(runner: ModelRunner, request_id: str, tokens, cached: int, num_samples: int = 1) -> SequenceWork:
    end = cached + len(tokens)
    ids = {name: tuple(g.provider.reserve(request_id, end)) for name, g in runner.groups.items()}
    return SequenceWork(request_id, tuple(tokens), cached, ids.pop(KV_GROUP), num_samples, GREEDY, 0, state_ids=ids)


def samples(runner: ModelRunner, items: list[SequenceWork]) -> dict[str, list[int]]:
    return {r.request_id: [s.token_id for s in r.sampled] for r in runner.execute(items).results}


def decode_one_by_one(runner: ModelRunner, prompt: list[int], then: list[int]) -> list[int]:
    """Prefill `prompt`, then feed `then` a token per step: the sample after each input."""
    out = samples(runner, [work(runner, "r", prompt, 0)])["r"]
    for index, token in enumerate(then):
        out += samples(runner, [work(runner, "r", [token], len(prompt) + index)])["r"]
    return out


PROMPT = [3, 17, 8, 8, 25, 1]
DRAFTS = [5, 9, 2]


def test_the_layer_specs_name_a_state_group_core_does_not_know():
    groups = SPEC.state_groups(torch.float32, torch.float32, PAGE)
    assert list(groups) == [COUNTER] and SPEC.group_index(1) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_verify_row_samples_each_draft_position_as_single_steps_do(device):
    """k = 3 draft tokens in, k + 1 samples out, equal to four one-token decode steps."""
    runner = build_runner(device)
    first = samples(runner, [work(runner, "r", PROMPT, 0)])["r"][0]
    verify = samples(runner, [work(runner, "r", [first, *DRAFTS], len(PROMPT), num_samples=len(DRAFTS) + 1)])
    reference = decode_one_by_one(build_runner(device), PROMPT, [first, *DRAFTS])
    assert [first, *verify["r"]] == reference


@pytest.mark.parametrize("device", DEVICES)
def test_rejected_tokens_roll_back_through_the_providers(device):
    runner = build_runner(device)
    first = samples(runner, [work(runner, "r", PROMPT, 0)])["r"][0]
    samples(runner, [work(runner, "r", [first, *DRAFTS], len(PROMPT), num_samples=4)])
    kv, counter = runner.groups[KV_GROUP].provider, runner.groups[COUNTER].provider
    accepted = len(PROMPT) + 2  # the first sample and one draft stand
    assert len(kv.held_by("r")) == 3  # 10 tokens over pages of 4
    kept = min(group.provider.rollback("r", accepted) for group in runner.groups.values())
    assert len(kv.held_by("r")) == 2 and counter.rollback("r", accepted) == kept == 0
    tokens = [*PROMPT, first, DRAFTS[0]][kept:]
    after = samples(runner, [work(runner, "r", tokens, kept)])["r"]
    assert after == decode_one_by_one(build_runner(device), PROMPT, [first, DRAFTS[0]])[-1:]


@pytest.mark.parametrize("device", DEVICES)
def test_the_graph_hooks_replay_decode_steps_as_eager_binding_does(device):
    """On a GPU through `DecodeGraphs` (captured, replayed); on the CPU the same hooks feed
    an uncaptured forward over the static buffers."""
    eager, replayed = build_runner(device), build_runner(device, graphs=device == "cuda")
    prompts = {"a": [4, 4, 9], "b": [7, 1, 30, 2, 2]}
    for runner in (eager, replayed):
        for request_id, prompt in prompts.items():
            samples(runner, [work(runner, request_id, prompt, 0)])
    for step in range(3):
        items = {
            name: [work(r, rid, [step + 1], len(p) + step) for rid, p in prompts.items()]
            for name, r in (("eager", eager), ("replayed", replayed))
        }
        want = samples(eager, items["eager"])
        if device == "cuda":
            got = samples(replayed, items["replayed"])
        else:
            got = _replay_without_capture(replayed, items["replayed"])
        assert got == want


def _replay_without_capture(runner: ModelRunner, items: list[SequenceWork]) -> dict[str, list[int]]:
    layout = BatchLayout(tuple(item.chunk() for item in items), len(items), PAGE)
    size = 4  # a bucket larger than the batch: padded rows must touch nobody's state
    if not hasattr(runner, "_hooks_ready"):
        for group in runner.groups.values():
            group.binder.prepare_capture(runner.workspace, group.provider, size, 16)
        runner._hooks_ready = True
    for group in runner.groups.values():
        group.binder.prepare_replay(layout, size)
    ids = torch.zeros(size, dtype=torch.long)
    ids[: len(items)] = torch.tensor([item.token_ids[0] for item in items])
    positions = torch.zeros(size, dtype=torch.long)
    positions[: len(items)] = torch.from_numpy(layout.positions)
    context = bind_groups(runner.groups, lambda binder: binder.capture_metadata(size))
    logits = runner.model.compute_logits(runner.model(ids, positions, context))[: len(items)]
    return {item.request_id: [int(row.argmax())] for item, row in zip(items, logits)}


@pytest.mark.parametrize("device", DEVICES)
def test_state_exported_to_host_and_imported_elsewhere_continues_the_sequence(device):
    source, target = build_runner(device), build_runner(device)
    first = samples(source, [work(source, "r", PROMPT, 0)])["r"][0]
    handle = StateCopy(source.groups).export("r", len(PROMPT))
    assert handle.location == "host" and handle.num_bytes > 0
    StateCopy(target.groups).import_(handle)
    assert target.groups[KV_GROUP].provider.held_by("r")
    moved = samples(target, [work(target, "r", [first], len(PROMPT))])["r"]
    stayed = samples(source, [work(source, "r", [first], len(PROMPT))])["r"]
    assert moved == stayed
