"""Tensor-parallel workers: one process per rank beyond the engine's own (rank 0).

Every rank builds the same engine parts for its shard of the model and joins one
torch.distributed group (gloo on the CPU, NCCL on CUDA, as the runtime says). Each step the
engine sends the step's plan (plain `SequenceWork`) to every worker, then runs it itself;
the collectives inside the forward keep the ranks in lockstep, and rank 0 alone samples.

A worker that fails reports why and exits; the engine notices it (a dead process, or a
collective that fails because a peer is gone) and raises `WorkerDiedError` instead of
waiting forever.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kestrel.config import EngineArgs
from kestrel.core.runner import LaunchedStep, ModelRunner, SequenceWork, StepOutput
from kestrel.core.sampling import TokenMasks
from kestrel.distributed.group import GroupAddress, rank_args

READY_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 120.0  # a worker's interpreter start and imports, not its model loading
# Where `kestrel` is imported from, so workers find the same copy from any working directory.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
SETTLE_AFTER_ERROR_S = 5.0
AUTHKEY_VARIABLE = "KESTREL_WORKER_AUTHKEY"  # how a worker process receives its connection key


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; the engine cannot run steps any more."""


@dataclass
class WorkerHandle:
    rank: int
    process: subprocess.Popen
    connection: Connection

    def failure(self) -> str | None:
        """Why the worker is unusable, if it is."""
        message = None
        while self.connection.poll():
            try:
                kind, detail = self.connection.recv()
            except (EOFError, OSError):
                break
            if kind == "error":
                message = detail
        if message is not None:
            return f"tensor-parallel worker rank {self.rank} failed: {message}"
        if self.process.poll() is not None:
            process = self.process
            return f"tensor-parallel worker rank {self.rank} (pid {process.pid}) died, exit code {process.returncode}"
        return None

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.send(None)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_workers(args: EngineArgs, address: GroupAddress) -> list[WorkerHandle]:
    """One `python -m kestrel.distributed.worker` process per rank beyond 0, connected back here."""
    authkey = secrets.token_bytes(32)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        host, port = listener.address
        environment = dict(os.environ, **{AUTHKEY_VARIABLE: authkey.hex()})
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, environment.get("PYTHONPATH")]))
        # Rank 0 already logs start-up; the workers say only what goes wrong.
        environment.setdefault("KESTREL_LOGGING_LEVEL", "WARNING")
        processes = {
            rank: subprocess.Popen(
                [sys.executable, "-m", "kestrel.distributed.worker", host, str(port), str(rank)], env=environment
            )
            for rank in range(1, address.world_size)
        }
        try:
            connections = _accept_workers(listener, processes)
        except BaseException:
            for process in processes.values():
                process.kill()
            raise
    for rank, connection in connections.items():
        connection.send((rank_args(args, rank), rank, address))
    return [WorkerHandle(rank, processes[rank], connections[rank]) for rank in sorted(processes)]


def _accept_workers(listener: Listener, processes: dict[int, subprocess.Popen]) -> dict[int, Connection]:
    """Each worker's connection, by the rank it announces; fails as soon as one exits first."""
    connections: dict[int, Connection] = {}

    def accept() -> None:
        for _ in processes:
            connection = listener.accept()
            connections[connection.recv()] = connection

    # `Listener.accept` takes no timeout: it runs on a thread while this one watches the processes.
    acceptor = threading.Thread(target=accept, name="kestrel-worker-accept", daemon=True)
    acceptor.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while acceptor.is_alive():
        acceptor.join(timeout=0.05)
        for rank, process in processes.items():
            if rank not in connections and process.poll() is not None:
                raise WorkerDiedError(
                    f"tensor-parallel worker rank {rank} exited with code {process.returncode} before it "
                    "connected; its error is printed above"
                )
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"tensor-parallel workers did not connect within {CONNECT_TIMEOUT_S:.0f} s")
    return connections


class TensorParallelExecutor(ABC):
    """Runs each step on rank 0's runner (here) and on every worker. A subclass says how
    workers are reached (processes on this host, or Ray actors)."""

    address: GroupAddress  # where the ranks meet

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None  # rank 0's, set once it is built
        self._stopped = False

    @abstractmethod
    def send(self, work: list[SequenceWork]) -> None:
        """Hand the step's plan to every worker."""

    @abstractmethod
    def failure(self) -> str | None:
        """What is wrong with the workers, if anything (a dead one, a reported error)."""

    @abstractmethod
    def wait_ready(self) -> None:
        """Block until every worker has built its rank; raise WorkerDiedError if one failed."""

    @abstractmethod
    def stop_workers(self) -> None: ...

    def launch(self, work: Sequence[SequenceWork], masks: TokenMasks | None = None) -> _GuardedStep:
        """Send the step to the workers and launch it here. Steps may overlap as on one rank:
        tokens rank 0 sampled reach the workers by a device broadcast
        (`Sampler.share_last`). Only rank 0 samples, so only it reads `masks`."""

        def step() -> LaunchedStep:
            self.raise_if_failed()
            self.send(list(work))
            return self.runner.launch(work, masks)

        return _GuardedStep(self.guarded(step), self)

    def guarded(self, action: Callable[[], Any]) -> Any:
        """Run `action`; if it fails because a worker is gone, say which and why."""
        try:
            return action()
        except WorkerDiedError:
            raise
        except (RuntimeError, OSError) as error:
            self.raise_if_failed(cause=error)
            raise

    def raise_if_failed(self, cause: BaseException | None = None) -> None:
        # After an error the failed worker may take a moment to be seen as gone.
        deadline = time.monotonic() + (SETTLE_AFTER_ERROR_S if cause is not None else 0)
        while (problem := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if problem is not None:
            raise WorkerDiedError(problem) from cause

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)  # sampling state lives on rank 0 only

    def shutdown(self) -> None:
        """Stop the workers and leave the process group; a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        self.stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class _GuardedStep:
    """A launched step whose result, if a worker fails meanwhile, says which one and why."""

    launched: LaunchedStep
    executor: TensorParallelExecutor

    def result(self) -> StepOutput:
        return self.executor.guarded(self.launched.result)


class MultiprocessExecutor(TensorParallelExecutor):
    """Workers are processes on this host, fed through pipes."""

    def __init__(self, workers: Sequence[WorkerHandle], address: GroupAddress) -> None:
        super().__init__()
        self.workers = list(workers)
        self.address = address

    def send(self, work: list[SequenceWork]) -> None:
        for worker in self.workers:
            worker.connection.send(work)

    def failure(self) -> str | None:
        return next((problem for worker in self.workers if (problem := worker.failure()) is not None), None)

    def wait_ready(self) -> None:
        for worker in self.workers:
            if not worker.connection.poll(READY_TIMEOUT_S):
                raise WorkerDiedError(f"tensor-parallel worker rank {worker.rank} did not start in time")
            kind, detail = worker.connection.recv()
            if kind != "ready":
                raise WorkerDiedError(f"tensor-parallel worker rank {worker.rank} failed to start: {detail}")

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()


class LocalExecutor:
    """One rank: steps run on the engine's own runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def launch(self, work: Sequence[SequenceWork], masks: TokenMasks | None = None) -> LaunchedStep:
        return self.runner.launch(work, masks)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def shutdown(self) -> None:
        return None
