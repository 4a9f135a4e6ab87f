"""The CPU runtime: eager execution, decode steps compiled where asked, gloo collectives."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import types
import warnings
from collections.abc import Callable

import torch

from kestrel.core.runtime.base import DeviceRuntime, MemoryInfo, Outputs

# glibc mallopt parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_FREED_BYTES = 1 << 30
CPU_WARM_UP_TOKENS = 32
CPU_WARM_UP_SEQS = 2


_CAPTURES = itertools.count()


def _with_own_code(forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """A function calling `forward` whose code object no other function shares: dynamo keeps
    compiled entries per code object, and guards no longer tell captures apart."""

    def step() -> Outputs:
        return forward()

    code = step.__code__.replace(co_name=f"captured_step_{next(_CAPTURES)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


class CpuRuntime(DeviceRuntime):
    name = "cpu"
    # A step's "graph" here is the step compiled by torch.compile (inductor): its norms,
    # rotary, casts and KV appends fused into a few C++ loops instead of hundreds of small
    # ops. Compiling takes tens of seconds, so it is asked for (`compilation_config`).
    supports_graphs = True
    graphs_by_default = False
    pads_graphs = False  # a padded row costs its arithmetic here: 1 row in a step of 32 ran 4x slower

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def default_dtype(self) -> torch.dtype:
        # Half precision matmuls are slow or missing on many CPUs; float32 is the safe default.
        return torch.float32

    def configure_process(self) -> None:
        # Softmax over a vocabulary produces subnormal floats, which are many times slower
        # on x86; flushing them to zero changes nothing visible in logprobs.
        torch.set_flush_denormal(True)
        # Per-step tensors (logits, gathered KV) are tens of MB; by default glibc hands such
        # blocks back to the OS on free, and every step then page-faults them in again.
        libc_name = ctypes.util.find_library("c")
        if libc_name and "libc.so" in libc_name:
            libc = ctypes.CDLL(libc_name)
            if hasattr(libc, "mallopt"):
                libc.mallopt(M_MMAP_THRESHOLD, KEEP_FREED_BYTES)
                libc.mallopt(M_TRIM_THRESHOLD, 2 * KEEP_FREED_BYTES)

    def capture_step(self, forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
        """`forward` compiled whole (no graph breaks: a break would put Python back between
        the pieces), compiled now by a first call.

        Like a CUDA graph, the compiled step is bound to this capture: it runs for the one
        step size it was captured at, over the same modules and buffers, with everything that
        varies between steps in those buffers' contents or in the dims the attention backend
        marks dynamic (read from the tensors at each call). So it checks no guards (dynamo's
        guards over ~400 parameters and buffers cost about 3 ms of a 20 ms step of a 30-layer
        model), and its code object is its own, so no other capture can match its cache
        entry."""
        # No size asserts: the step's buffers are the runtime's own, and checking ~700 of them
        # cost half a millisecond a step.
        options: dict[str, object] = {"size_asserts": False}
        skip_guards = getattr(torch.compiler, "skip_all_guards_unsafe", None)
        if skip_guards is not None:
            options["guard_filter_fn"] = skip_guards
        compiled = torch.compile(_with_own_code(forward), fullgraph=True, options=options)
        with warnings.catch_warnings():
            # Dynamo traces through lru_cache'd helpers (rotary frequencies): pure functions of
            # their arguments here, so tracing them computes what the cache would return.
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
            compiled()
        return compiled

    def warm_up_size(self, max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, int]:
        # Nothing compiles here and the KV budget is explicit, so the largest step would only
        # cost time (39 of the 48 s a 135M model took to start on 2 cores): a small step
        # still runs every layer once before the first request.
        return min(max_num_batched_tokens, CPU_WARM_UP_TOKENS), min(max_num_seqs, CPU_WARM_UP_SEQS)

    def memory_info(self) -> MemoryInfo:
        page_size = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page_size
        free = os.sysconf("SC_AVPHYS_PAGES") * page_size
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        return None

    def distributed_backend(self) -> str:
        return "gloo"
