"""StepBinder: how one state group's per-step metadata is made, eagerly or for a captured graph.

An attention backend is the binder of its KV group; a state provider whose layers need
per-step facts (the recurrent state's slots) is its own. A captured graph reads metadata
from static buffers, so a binder that joins graphs implements three hooks besides `bind`:

- `prepare_capture`: take the static buffers (from the `Workspace`) for the largest bucket,
  and whatever of the group's provider they point into (its scratch unit, its layers);
- `capture_metadata(num_rows)`: metadata over those buffers, as the graph of a bucket reads it
  (called inside the capture, so what it computes from the buffers is replayed too);
- `prepare_replay(layout, num_rows)`: write one step's facts into them, padded rows pointing
  at the provider's scratch unit, which no request owns.

`core/decode_graphs.py` knows nothing else about any binder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kestrel.core.batch import BatchLayout
from kestrel.core.workspace import Workspace

if TYPE_CHECKING:
    from kestrel.core.state import StateProvider


class StepBinder(ABC):
    supports_graphs: bool = False  # whether the three graph hooks are implemented
    # Whether the layers reading this binder's capture metadata trace whole into a compiled
    # CPU step (no host syncs, no data-dependent shapes) and stay fast there.
    compiles: bool = False
    # Whether a graph's rows see the keys other rows of their sequence store in the same step
    # (a verify chunk laid out as one-token rows needs it).
    graph_rows_see_each_other: bool = True

    @abstractmethod
    def bind(self, layout: BatchLayout) -> Any:
        """The metadata of one step, shared by every layer of the group."""

    def prepare_capture(self, workspace: Workspace, provider: StateProvider, max_rows: int, max_pages: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join captured graphs")

    def capture_metadata(self, num_rows: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not join captured graphs")

    def prepare_replay(self, layout: BatchLayout, num_rows: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join captured graphs")
