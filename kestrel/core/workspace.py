"""Workspace: named scratch buffers, preallocated once at their largest size.

Buffers keep stable addresses for the runner's lifetime, so later steps (and captured
graphs) reuse them instead of allocating.
"""

from __future__ import annotations

import torch


class Workspace:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def reserve(self, name: str, max_numel: int, dtype: torch.dtype) -> None:
        """Allocate `name` once, big enough for every later `get`."""
        existing = self._buffers.get(name)
        if existing is not None and existing.numel() >= max_numel and existing.dtype == dtype:
            return
        self._buffers[name] = torch.zeros(max_numel, dtype=dtype, device=self.device)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of the reserved buffer `name` with `shape`; never allocates."""
        buffer = self._buffers.get(name)
        if buffer is None:
            raise KeyError(f"workspace buffer {name!r} was never reserved")
        numel = 1
        for size in shape:
            numel *= size
        if buffer.dtype != dtype or numel > buffer.numel():
            raise ValueError(
                f"workspace buffer {name!r} holds {buffer.numel()} x {buffer.dtype}, asked for {shape} x {dtype}"
            )
        return buffer[:numel].view(shape)
