"""Backend selection: pick the first registered backend whose capabilities fit, or say why none do."""

from __future__ import annotations

from kestrel.core.attention.base import AttentionBackend, BackendRequirements
from kestrel.core.attention.torch_cpu import TorchCpuBackend
from kestrel.core.attention.torch_ref import TorchReferenceBackend
from kestrel.core.attention.triton_mla import TritonMlaBackend
from kestrel.core.attention.triton_paged import TritonPagedBackend

# In order of preference; faster, narrower backends go first.
BACKENDS: tuple[type[AttentionBackend], ...] = (
    TritonPagedBackend,
    TritonMlaBackend,
    TorchCpuBackend,
    TorchReferenceBackend,
)


class NoAttentionBackendError(ValueError):
    pass


def select_backend(needs: BackendRequirements, preferred: str | None = None) -> type[AttentionBackend]:
    candidates = [b for b in BACKENDS if preferred is None or b.name == preferred]
    if not candidates:
        names = ", ".join(b.name for b in BACKENDS)
        raise NoAttentionBackendError(f"unknown attention backend {preferred!r}; known: {names}")
    report = []
    for backend in candidates:
        reasons = backend.refusals(needs)
        if not reasons:
            return backend
        report.append(f"{backend.name}: " + "; ".join(reasons))
    raise NoAttentionBackendError("no attention backend fits this model: " + " | ".join(report))
