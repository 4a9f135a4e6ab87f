"""Kestrel's log output, set up as vLLM sets up its own: the `kestrel` logger writes INFO and
above to stderr unless the application configured it or `KESTREL_CONFIGURE_LOGGING=0`."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging() -> None:
    if os.environ.get("KESTREL_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("kestrel")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("KESTREL_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False


@contextlib.contextmanager
def log_duration(logger: logging.Logger, what: str) -> Iterator[None]:
    """Log `what` as it starts and how long it took as it ends (start-up progress)."""
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)
