"""StepBinder: how one state group's per-step metadata is made, eagerly or for a captured graph.

An attention backend is the binder of its KV group; a state provider whose layers need
per-step facts (the recurrent state's slots) is its own. A captured graph reads metadata
from static buffers, so a binder that joins graphs implements three hooks besides `bind`:

- `prepare_capture`: take the static buffers (from the `Workspace`) for the largest bucket;
- `capture_metadata(num_rows)`: metadata over those buffers, as the graph of a bucket reads it
  (called inside the capture, so what it computes from the buffers is replayed too);
- `prepare_replay(layout, num_rows)`: write one step's facts into them, padded rows pointing
  at the provider's scratch unit, which no request owns.

`core/cuda_graphs.py` knows nothing else about any binder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kestrel.core.batch import BatchLayout
from kestrel.core.workspace import Workspace


class StepBinder(ABC):
    supports_graphs: bool = False  # whether the three graph hooks are implemented

    @abstractmethod
    def bind(self, layout: BatchLayout) -> Any:
        """The metadata of one step, shared by every layer of the group."""

    def prepare_capture(self, workspace: Workspace, scratch: int, max_rows: int, max_pages: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join captured graphs")

    def capture_metadata(self, num_rows: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not join captured graphs")

    def prepare_replay(self, layout: BatchLayout, num_rows: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join captured graphs")
