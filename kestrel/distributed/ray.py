"""Tensor-parallel workers as Ray actors, for models split across hosts.

The engine (rank 0) joins the Ray cluster named by RAY_ADDRESS, or the one `ray start
--head` left running on this host, and places one actor per further rank. The ranks meet
over TCP at this host's address, so actors on other hosts can reach it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from kestrel.config import EngineArgs
from kestrel.core.runner import SequenceWork
from kestrel.distributed.executor import TensorParallelExecutor, WorkerDiedError
from kestrel.distributed.group import GroupAddress, rank_args


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install ray, then start a cluster "
            "(ray start --head on the first host, ray start --address=<head>:6379 on the others)"
        ) from None
    return ray


class RankActor:
    """One worker rank inside a Ray actor (wrapped with ray.remote at start-up)."""

    def start(self, build_runner: Callable, args: EngineArgs, rank: int, address: GroupAddress) -> int:
        self.runner = build_runner(args, rank, address)
        return os.getpid()

    def execute(self, work: list[SequenceWork]) -> None:
        self.runner.execute(work)


class RayExecutor(TensorParallelExecutor):
    def __init__(self, args: EngineArgs, build_runner: Callable[[EngineArgs, int, GroupAddress], Any]) -> None:
        """`build_runner(args, rank, address)` builds a worker's rank inside its actor (Ray ships
        it by reference, so the actor imports it itself)."""
        super().__init__()
        self.ray = _import_ray()
        if not self.ray.is_initialized():
            self.ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        host = self.ray.util.get_node_ip_address()
        self.address = GroupAddress(f"tcp://{host}:{_free_port()}", args.tensor_parallel_size)
        on_gpu = rank_args(args, 0).device.startswith("cuda")
        actor = self.ray.remote(num_cpus=1, num_gpus=1 if on_gpu else 0)(RankActor)
        self.actors = [actor.remote() for _ in range(1, args.tensor_parallel_size)]
        # A Ray actor sees only the GPU it was given, as cuda:0.
        self._starting = [
            handle.start.remote(build_runner, rank_args(args, 0) if on_gpu else args, rank, self.address)
            for rank, handle in enumerate(self.actors, start=1)
        ]
        self._last_step: list[Any] = []

    def send(self, work: list[SequenceWork]) -> None:
        self._last_step = [handle.execute.remote(work) for handle in self.actors]

    def failure(self) -> str | None:
        pending = self._last_step + self._starting
        if not pending:
            return None
        done, _ = self.ray.wait(pending, num_returns=len(pending), timeout=0)
        for reference in done:
            try:
                self.ray.get(reference)
            except Exception as error:  # noqa: BLE001 (Ray wraps the worker's error)
                return f"a tensor-parallel Ray worker failed: {error}"
        return None

    def wait_ready(self) -> None:
        try:
            self.pids = self.ray.get(self._starting)
        except Exception as error:  # noqa: BLE001
            raise WorkerDiedError(f"a tensor-parallel Ray worker failed to start: {error}") from error
        self._starting = []

    def stop_workers(self) -> None:
        for handle in self.actors:
            self.ray.kill(handle)
        self.actors = []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
