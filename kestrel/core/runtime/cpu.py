"""The CPU runtime: eager execution, gloo collectives."""

from __future__ import annotations

import os

import torch

from kestrel.core.runtime.base import DeviceRuntime, MemoryInfo


class CpuRuntime(DeviceRuntime):
    name = "cpu"
    supports_graphs = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def default_dtype(self) -> torch.dtype:
        # Half precision matmuls are slow or missing on many CPUs; float32 is the safe default.
        return torch.float32

    def memory_info(self) -> MemoryInfo:
        page_size = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page_size
        free = os.sysconf("SC_AVPHYS_PAGES") * page_size
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        return None

    def distributed_backend(self) -> str:
        return "gloo"
