"""`python -m kestrel.engine.worker HOST PORT RANK`: one tensor-parallel worker process.

Workers start as fresh interpreters on this module, never on the user's script: a
multiprocessing "spawn" child re-imports the parent's `__main__`, so a script without an
`if __name__ == "__main__":` guard would build a second engine inside every worker. The
worker connects back to the engine (authenticated with a key it reads from its environment),
receives its rank's arguments, and serves steps as `worker_main` says.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Client

AUTHKEY_VARIABLE = "KESTREL_WORKER_AUTHKEY"


def main(argv: list[str]) -> int:
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_VARIABLE))
    connection = Client((host, port), authkey=authkey)
    connection.send(rank)
    args, rank, address = connection.recv()

    from kestrel.engine.distributed import worker_main

    worker_main(args, rank, address, connection)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
