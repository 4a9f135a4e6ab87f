"""Transfer: moving a request's state between places (host swap, prefill -> decode instance)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TransferHandle:
    """Where a request's exported state lies, and enough to import it elsewhere."""

    request_id: str
    num_tokens: int
    location: str  # e.g. "host", or an address of another instance


class Transfer(Protocol):
    def export(self, request_id: str) -> TransferHandle:
        """Copy the request's state out; its pages stay owned by the request until released."""
        ...

    def import_(self, handle: TransferHandle) -> list[int]:
        """Bring the state in; returns the page ids now owned by the request."""
        ...
