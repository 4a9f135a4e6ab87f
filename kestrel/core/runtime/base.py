"""DeviceRuntime: everything Kestrel needs to know about one kind of device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

Outputs = TypeVar("Outputs")


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes, as the runtime measures it now."""

    free_bytes: int
    total_bytes: int


class HostTransfer:
    """Device tensors on their way to the host; `wait` returns the host copies.

    The base class is for tensors already on the host: nothing to wait for.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


class DeviceRuntime(ABC):
    """One kind of device: its torch device, dtypes, memory, synchronisation and collectives.

    Everything device-specific that the runner, state providers and backends need goes
    through this object, so a new device is one new subclass.
    """

    name: str
    supports_graphs: bool = False  # whether `capture_step` works here
    graphs_by_default: bool = False  # whether decode steps are captured unless asked not to be
    # Whether a graph may run a smaller batch padded to its size: where padded rows cost
    # little (a memory-bound GPU step), not where they cost their full arithmetic.
    pads_graphs: bool = True

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]: ...

    @abstractmethod
    def default_dtype(self) -> torch.dtype: ...

    @abstractmethod
    def memory_info(self) -> MemoryInfo: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def distributed_backend(self) -> str:
        """The torch.distributed backend for collectives between ranks on this device."""

    def peak_bytes_during(self, run: Callable[[], None]) -> int:
        """Call `run`; return the most memory it held at once beyond what was allocated before.

        0 where the runtime cannot measure it (the CPU: its budgets are explicit).
        """
        run()
        return 0

    def warm_up_size(self, max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, int]:
        """How many tokens and sequences the warm-up steps run: by default the largest step the
        planner may send, which compiles every kernel shape and sizes the activations."""
        return max_num_batched_tokens, max_num_seqs

    def warm_up_smaller_prefills(self, num_tokens: int) -> list[int]:
        """Token counts of further warm-up prefill steps below `num_tokens`: none by default."""
        return []

    def to_host_async(self, tensors: Sequence[torch.Tensor]) -> HostTransfer:
        """Start copying `tensors` to the host behind the work queued so far; the host does
        not wait until `wait()` is called on the result."""
        return HostTransfer(tensors)

    def capture_step(self, forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
        """`forward` (a step reading its inputs from static buffers) as a graph: a callable that
        runs the same step again, on whatever the buffers then hold, returning its outputs."""
        raise NotImplementedError(f"the {self.name} runtime does not capture steps")

    def configure_process(self) -> None:
        """Process-wide settings this device wants before the first step; none by default."""
        return None

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.supported_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes())
            raise ValueError(f"dtype {dtype} is not supported on {self.name}; choose one of: {names}")
