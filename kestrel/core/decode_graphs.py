"""Decode steps as graphs: one per batch-size bucket, captured largest first, padding to the
bucket, and replay keyed by `GraphKey`. What a graph is belongs to the runtime
(`DeviceRuntime.capture_step`): a CUDA graph on CUDA, a compiled step on the CPU.

This module owns only the token inputs (ids and positions). Every state group's binder
supplies its own static metadata through the graph hooks of `StepBinder`, so any backend or
state provider that implements them joins the graphs. Padded rows decode token 0 at
position 0, and each binder points them at its provider's scratch unit, so they touch no
request's state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from kestrel.core.batch import BatchLayout, to_device
from kestrel.core.forward import bind_groups
from kestrel.core.graph import GraphKey, GraphPhase
from kestrel.core.runtime.base import DeviceRuntime
from kestrel.core.state import StateGroup
from kestrel.core.workspace import Workspace

_TOKEN_INPUTS = "graph.input_ids_and_positions"


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, up to `max_num_seqs`."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        buckets.append(size)
        size += 8 if size < 64 else 16
    return buckets + [max_num_seqs]


def graphs_supported(groups: Mapping[str, StateGroup]) -> bool:
    return all(group.binder.supports_graphs for group in groups.values())


def check_compiles(groups: Mapping[str, StateGroup]) -> None:
    """Refuse compiled steps, by name, for state groups whose binders do not trace into them."""
    refusing = {name: type(group.binder).__name__ for name, group in groups.items() if not group.binder.compiles}
    if refusing:
        named = ", ".join(f"{name!r} (bound by {binder})" for name, binder in sorted(refusing.items()))
        raise ValueError(
            f"compilation_config: this model's state groups {named} do not join compiled steps yet; run it eagerly"
        )


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        groups: Mapping[str, StateGroup],
        workspace: Workspace,
        runtime: DeviceRuntime,
        buckets: Sequence[int],
        max_pages_per_seq: int,
    ) -> None:
        """`buckets`: the batch sizes captured, ascending (`decode_buckets` on CUDA)."""
        if not graphs_supported(groups):
            refusing = sorted(name for name, group in groups.items() if not group.binder.supports_graphs)
            raise ValueError(f"state groups {refusing} cannot join captured graphs")
        self.model, self.groups, self.runtime = model, groups, runtime
        # Whether a verify chunk may run as one-token rows of its sequence (runner.py).
        self.verify_rows = all(group.binder.graph_rows_see_each_other for group in groups.values())
        self.buckets = list(buckets)
        largest = self.buckets[-1]
        workspace.reserve(_TOKEN_INPUTS, 2 * largest, torch.long)
        self.tokens = workspace.get(_TOKEN_INPUTS, (2, largest), torch.long)
        self.input_ids, self.positions = self.tokens
        for group in groups.values():
            group.binder.prepare_capture(workspace, group.provider, largest, max_pages_per_seq)
        self._graphs: dict[GraphKey, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}  # hidden, logits
        self._last: tuple[torch.Tensor, int] | None = None  # the last replay's hidden states and rows

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        context = bind_groups(self.groups, lambda binder: binder.capture_metadata(size))
        hidden = self.model(self.input_ids[:size], self.positions[:size], context)
        return hidden, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.buckets):  # largest first, so smaller ones fit in its memory
            self._graphs[GraphKey(GraphPhase.DECODE, size)] = self.runtime.capture_step(
                lambda size=size: self._forward(size)
            )

    def bucket_for(self, num_seqs: int) -> int | None:
        """The graph a step of `num_seqs` rows runs in: the smallest that fits it, or, where
        the runtime does not pad graphs, one of exactly its size."""
        if not self.runtime.pads_graphs:
            return num_seqs if num_seqs in self.buckets else None
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(
        self,
        layout: BatchLayout,
        token_ids: Sequence[int],
        fill_input_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only step, by replaying the bucket's graph.

        `fill_input_ids`, if given, amends the static input ids on the device before the
        replay (the runner writes tokens sampled by the previous step, not yet on the host).
        """
        count = len(layout.chunks)
        size = self.bucket_for(count)
        tokens = np.zeros((2, size), dtype=np.int64)
        tokens[0, :count] = token_ids
        tokens[1, :count] = layout.positions
        self.tokens[:, :size].copy_(to_device(tokens, self.input_ids.device))
        for group in self.groups.values():
            group.binder.prepare_replay(layout, size)
        if fill_input_ids is not None:
            fill_input_ids(self.input_ids[:count])
        hidden, logits = self._graphs[GraphKey(GraphPhase.DECODE, size)]()
        self._last = (hidden, count)
        return logits[:count]

    def last_hidden_states(self) -> torch.Tensor:
        """The last replay's final hidden states [num_seqs, hidden]: graph memory, overwritten
        by the next replay."""
        hidden, count = self._last
        return hidden[:count]
