"""Device runtimes, and the choice of one from a user's `device` setting."""

from __future__ import annotations

import torch

from kestrel.core.runtime.base import DeviceRuntime, MemoryInfo
from kestrel.core.runtime.cpu import CpuRuntime

__all__ = ["DeviceRuntime", "MemoryInfo", "CpuRuntime", "create_runtime"]


def create_runtime(device: str) -> DeviceRuntime:
    """Resolve "auto" | "cpu" | "cuda" | "cuda:N" into a runtime."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return CpuRuntime()
    if device == "cuda" or device.startswith("cuda:"):
        from kestrel.core.runtime.cuda import CudaRuntime

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return CudaRuntime(index)
    raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
