"""Transfer: moving a request's state between places (host swap, prefill -> decode instance).

`StateCopy` is the implementation: it copies everything a request holds in every state group
(KV pages, recurrent slots) out to a place, host memory by default, and back into freshly
reserved units. The engine uses it to preempt by swapping rather than recomputing
(`preemption_mode="swap"`). The same handles carry a prompt's state from a prefill instance to
a decode instance: the prefill instance exports it, and either `encode_handle` turns host
copies into bytes for the wire (TCP), or the copies stay on the GPU and `core/cuda_ipc.py`
lends them to a decode process on the same host; the decode instance checks (`check_import`)
and imports what it read back.

Ownership: `export` leaves the request's units with it (the caller releases them); the
handle owns the host copies; `import_` reserves new units for the request and fills them.
"""

from __future__ import annotations

import io
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


class StateCopy:
    """Copies request state between the device pools and `place`: host memory (a swap, or
    bytes for another instance) or device memory (lent to another process on the GPU)."""

    def __init__(self, groups: Mapping[str, StateGroup], place: torch.device | str = "cpu") -> None:
        self.groups = groups
        self.place = torch.device(place)

    def export(self, request_id: str, num_tokens: int) -> TransferHandle:
        for group in self.groups.values():
            group.provider.rollback(request_id, num_tokens)  # nothing past the computed tokens
        state = {name: group.provider.export(request_id, self.place) for name, group in self.groups.items()}
        location = "host" if self.place.type == "cpu" else str(self.place)
        return TransferHandle(request_id, num_tokens, location, state)

    def check_import(self, handle: TransferHandle) -> None:
        """Raise ValueError, saying what differs, where the handle's state cannot be imported
        here (another model, page size or dtype)."""
        if set(handle.state) != set(self.groups):
            raise ValueError(f"state groups {sorted(handle.state)} do not match this model's {sorted(self.groups)}")
        for name, group in self.groups.items():
            try:
                group.provider.check_import(handle.num_tokens, handle.state[name])
            except ValueError as error:
                raise ValueError(f"state group {name!r}: {error}") from None

    def import_(self, handle: TransferHandle) -> dict[str, list[int]]:
        return {
            name: group.provider.import_state(handle.request_id, handle.num_tokens, handle.state[name])
            for name, group in self.groups.items()
        }


def encode_handle(handle: TransferHandle) -> bytes:
    """The handle as bytes for another instance (tensors in torch's format, no code)."""
    buffer = io.BytesIO()
    state = {name: list(tensors) for name, tensors in handle.state.items()}
    torch.save({"request_id": handle.request_id, "num_tokens": handle.num_tokens, "state": state}, buffer)
    return buffer.getvalue()


def decode_handle(data: bytes, location: str) -> TransferHandle:
    """`encode_handle`'s bytes back into a handle; anything else is a ValueError. Read with
    `weights_only`, so bytes from the network can hold tensors and plain values only."""
    try:
        payload = torch.load(io.BytesIO(data), weights_only=True)
        state = {str(name): list(tensors) for name, tensors in payload["state"].items()}
        handle = TransferHandle(str(payload["request_id"]), int(payload["num_tokens"]), location, state)
    except Exception as error:  # a truncated or foreign payload: say so, whatever torch raised
        raise ValueError(f"not a Kestrel state transfer: {type(error).__name__}: {error}") from None
    if not all(isinstance(t, torch.Tensor) for tensors in state.values() for t in tensors):
        raise ValueError("not a Kestrel state transfer: its state holds something other than tensors")
    return handle
