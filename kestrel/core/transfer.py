"""Transfer: moving a request's state between places (host swap, prefill -> decode instance).

`HostSwap` is the first implementation: it copies everything a request holds in every state
group (KV pages, recurrent slots) to host memory, and back into freshly reserved units. The
engine uses it to preempt by swapping rather than recomputing (`preemption_mode="swap"`).
Ownership: `export` leaves the request's units with it (the caller releases them); the
handle owns the host copies; `import_` reserves new units for the request and fills them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from kestrel.core.state import StateGroup


@dataclass(frozen=True)
class TransferHandle:
    """Where a request's exported state lies, and enough to import it elsewhere."""

    request_id: str
    num_tokens: int  # tokens whose state it holds
    location: str  # e.g. "host", or an address of another instance
    state: Mapping[str, list[torch.Tensor]]  # per state group, what its provider exported

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.state.values() for t in tensors)


class Transfer(Protocol):
    def export(self, request_id: str, num_tokens: int) -> TransferHandle:
        """Copy the state of the request's first `num_tokens` tokens out; its units stay
        owned by the request until released."""
        ...

    def import_(self, handle: TransferHandle) -> dict[str, list[int]]:
        """Bring the state in; returns, per state group, the units now owned by the request."""
        ...


class HostSwap:
    """Swaps request state between the device pools and host memory."""

    location = "host"

    def __init__(self, groups: Mapping[str, StateGroup]) -> None:
        self.groups = groups

    def export(self, request_id: str, num_tokens: int) -> TransferHandle:
        for group in self.groups.values():
            group.provider.rollback(request_id, num_tokens)  # nothing past the computed tokens
        state = {name: group.provider.export(request_id) for name, group in self.groups.items()}
        return TransferHandle(request_id, num_tokens, self.location, state)

    def import_(self, handle: TransferHandle) -> dict[str, list[int]]:
        return {
            name: group.provider.import_state(handle.request_id, handle.num_tokens, handle.state[name])
            for name, group in self.groups.items()
        }
