"""Kestrel's own CPU kernels (core/runtime/cpu_kernels.cpp), for x86 CPUs with AVX-512 VNNI, built
on first use:

- `int4_matvec`: 4-bit weights at a few rows (layers/int4_cpu.py holds their layout);
- `float_matvec`: one row times a float32 weight, prefetched (`choose_cpu_matvecs`);
- `decode_attention`: one query row per sequence over the compiled decode steps' mirrors
  (core/attention/torch_cpu.py), where `F.scaled_dot_product_attention` spends about 45 us a
  call in set-up around a few microseconds of arithmetic.

They are compiled with torch's C++ extension builder (a C++ compiler and ninja) into torch's
extension cache (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions): about 20 s
the first time on 2 cores, a load afterwards. Where they cannot run (another CPU, no compiler,
or KESTREL_CPU_KERNELS=torch in the environment) every caller keeps torch's ops, which stay
the reference the kernels are tested against.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger("kestrel")

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-fopenmp"]
_NEEDS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


@functools.cache
def available() -> bool:
    """Whether this CPU runs the kernels and they could be built (decided once per process)."""
    choice = os.environ.get("KESTREL_CPU_KERNELS", "kestrel")
    if choice not in ("kestrel", "torch"):
        raise ValueError(f"KESTREL_CPU_KERNELS={choice!r}: expected 'kestrel' (the default) or 'torch'")
    if choice == "torch":
        return False
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not _cpu_has(_NEEDS):
        return False
    try:
        _build()
    except Exception as error:  # a missing compiler or ninja: torch's ops serve
        logger.warning("Kestrel's CPU kernels could not be built; torch's ops are used instead")
        logger.debug("building Kestrel's CPU kernels failed: %s", error)
        return False
    return True


def ops():
    """The kernels' namespace, `torch.ops.kestrel_cpu` (only once `available()`)."""
    return torch.ops.kestrel_cpu


def _cpu_has(flags: tuple[str, ...]) -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return set(flags) <= set(line.split())


@functools.cache  # once per process, whatever `available` is asked again
def _build() -> None:
    from torch.utils.cpp_extension import load

    load("kestrel_cpu", sources=[str(_SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)

    # Shapes alone, for torch.compile's tracing.
    @torch.library.register_fake("kestrel_cpu::int4_matvec")
    def _(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("kestrel_cpu::float_matvec")
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("kestrel_cpu::decode_attention")
    def _(query, keys, values, first, last, scale, sinks) -> torch.Tensor:
        return torch.empty_like(query)


def takes_float_matvec(weight: torch.Tensor) -> bool:
    """Whether `float_matvec` takes this weight (float32 on the CPU, contiguous, 16-wide rows
    taken four at a time)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
        and weight.shape[0] % 4 == 0
    )


def choose_cpu_matvecs(model: torch.nn.Module) -> int:
    """Set `use_gemv` on every module of `model` whose `matvec_weight` `float_matvec` takes (where
    the kernels run), so that its one-row products take it; returns how many."""
    if not available():
        return 0
    chosen = 0
    for module in model.modules():
        weight = getattr(module, "matvec_weight", None)
        if isinstance(weight, torch.Tensor) and takes_float_matvec(weight):
            module.use_gemv = True
            chosen += 1
    return chosen
