"""`python -m kestrel.distributed.worker HOST PORT RANK`: one tensor-parallel worker process.

Workers start as fresh interpreters on this module, never on the user's script: a
multiprocessing "spawn" child re-imports the parent's `__main__`, so a script without an
`if __name__ == "__main__":` guard would build a second engine inside every worker. The
worker connects back to the engine (authenticated with a key it reads from its environment),
receives its rank's arguments, builds its rank and serves steps until the engine goes away.

This module is an entry point: it imports the composition root, and nothing imports it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from multiprocessing.connection import Client, Connection

import torch.distributed as dist

from kestrel.config import EngineArgs
from kestrel.distributed.executor import AUTHKEY_VARIABLE
from kestrel.distributed.group import GroupAddress
from kestrel.engine.composition import build_worker_runner


def worker_main(args: EngineArgs, rank: int, address: GroupAddress, connection: Connection) -> None:
    """A worker process: build this rank's parts, then run every step it is sent."""
    try:
        runner = build_worker_runner(args, rank, address)
        connection.send(("ready", None))
        while (work := connection.recv()) is not None:
            runner.execute(work)
    except EOFError:
        pass  # the engine went away: nothing left to serve
    except BaseException as error:  # noqa: BLE001 (report anything, then exit)
        summary = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        with contextlib.suppress(OSError):
            connection.send(("error", summary))
        os._exit(1)  # drop out of the group at once, so peers' collectives fail fast
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_VARIABLE))
    connection = Client((host, port), authkey=authkey)
    connection.send(rank)
    args, rank, address = connection.recv()
    worker_main(args, rank, address, connection)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
