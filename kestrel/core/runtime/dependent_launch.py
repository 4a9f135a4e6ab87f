"""Programmatic dependent launch (Hopper and later GPUs).

At batch 1 a decode step is a chain of some three hundred small kernels, and each one's
start-up and last wave leave the GPU partly idle. Launched as dependent, a kernel may start
as soon as every program of the kernel before it has started: it fetches what does not
depend on that kernel (a matvec's weights) and then waits for it (`wait_for_inputs`). The
wait is what keeps this correct, so a kernel launched so must call it before it reads
anything an earlier kernel wrote, and before it writes anything, on every path.

The engine argument `dependent_launch=False` (`--no-dependent-launch`) turns it off, to
measure it or to rule it out: the composition root passes it to `configure` before any kernel
is launched, and the setting holds for the process (kernels launch the same way on every path).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_allowed = [True]  # the process's setting, written by `configure` alone


def configure(enabled: bool) -> None:
    """Allow dependent launches on GPUs that support them, or turn them off."""
    _allowed[0] = enabled
    dependent_launch.cache_clear()


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` are launched as dependent (CUDA, compute capability 9+)."""
    if device.type != "cuda" or not _allowed[0]:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent_launch_args(device: torch.device) -> dict[str, bool]:
    """A kernel's launch arguments for this: its DEPENDENT switch and Triton's launch flag."""
    dependent = dependent_launch(device)
    return {"DEPENDENT": dependent, "launch_pdl": dependent}


@triton.jit
def wait_for_inputs(DEPENDENT: tl.constexpr):
    """Let the next kernel start (it waits in its turn), then wait until the kernel before
    this one has finished and its writes are visible. Nothing without DEPENDENT."""
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def wait_then_release(DEPENDENT: tl.constexpr):
    """`wait_for_inputs` in the other order: wait for the kernel before this one, then let the
    next kernel start. That next kernel may then read, before its own wait, what any kernel
    before this one wrote (they have all finished): the expert down matvec reads its token's
    experts, and requests its first weights, while the gate/up matvec before it runs."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
