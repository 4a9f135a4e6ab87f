"""Tensor-parallel groups: where the ranks meet, and which device each rank drives."""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import dataclass, replace
from datetime import timedelta

import torch.distributed as dist

from kestrel.config import EngineArgs
from kestrel.core.parallel import TensorParallel

# A collective that waits longer than this on a silent peer fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks meet: a torch.distributed init method (a file for ranks on one host,
    a TCP address for ranks across hosts)."""

    init_method: str
    world_size: int

    @classmethod
    def on_this_host(cls, world_size: int) -> GroupAddress:
        handle, path = tempfile.mkstemp(prefix="kestrel-tp-")
        os.close(handle)
        os.unlink(path)  # the store creates it; a stale file would confuse a new group
        return cls(f"file://{path}", world_size)


def rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """Each CUDA rank drives its own device, counting from the one asked for ("cuda:2"
    puts rank 1 on cuda:3); CPU ranks share the host."""
    device = args.device
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        first = int(device.split(":", 1)[1]) if ":" in device else 0
        return replace(args, device=f"cuda:{first + rank}")
    return args


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def join_group(address: GroupAddress, rank: int, backend: str) -> TensorParallel:
    if dist.is_initialized():
        gc.collect()  # an engine deleted but not yet collected releases its group when it is
    if dist.is_initialized():
        raise RuntimeError(
            "another tensor-parallel engine in this process still holds the process group; "
            "call shutdown() on it (or use `with LLM(...) as llm:`) before starting another"
        )
    dist.init_process_group(
        backend,
        init_method=address.init_method,
        rank=rank,
        world_size=address.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return TensorParallel(rank, address.world_size)
