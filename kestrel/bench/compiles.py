"""Triton kernels compiled while a block of code runs: after start-up there should be none
(a compile in the middle of serving stalls every request in flight for a second or more)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import triton


@contextmanager
def recorded_compiles() -> Iterator[list[str]]:
    """Yields a list that fills with one line per kernel compiled inside the block: its name,
    its constexprs and specialised arguments, and their attributes (alignment, divisibility)."""
    compiled: list[str] = []

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> None:
        compiled.append(f"{fn.name} {compile['constants']} {compile['signature']} {compile['configs']}")

    triton.knobs.runtime.jit_post_compile_hook = record
    try:
        yield compiled
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
