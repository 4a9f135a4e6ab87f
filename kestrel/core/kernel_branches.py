"""Where the Triton kernels run: on CUDA tensors, and, in tests, on CPU tensors too.

Layers choose between a Triton kernel and their torch path by `runs_kernels(tensor)`, and
attention backends built on Triton kernels fit a device by `kernel_devices`. Inside
`kernels_on_cpu` (tests, with Triton's interpreter) both say yes to the CPU, so CI runs a
whole model through the branches a GPU takes and checks them against the torch path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_on_cpu = False


@contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Tests only: CPU tensors take the Triton branches, run by Triton's interpreter."""
    global _on_cpu
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernels_on_cpu needs TRITON_INTERPRET=1 (set before Triton is imported)")
    _on_cpu = True
    try:
        yield
    finally:
        _on_cpu = False


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether an op on `x` takes its Triton kernel."""
    return x.is_cuda or (_on_cpu and x.device.type == "cpu")


def kernel_devices(devices: frozenset[str]) -> frozenset[str]:
    """The device types a Triton backend that runs on `devices` runs on now."""
    return devices | {"cpu"} if _on_cpu and "cuda" in devices else devices
