"""GraphPhase: which shape of step runs, and whether it runs eagerly or as a captured graph."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class GraphPhase(Enum):
    PREFILL = "prefill"  # every sequence brings more than one new token
    DECODE = "decode"  # every sequence brings exactly one new token
    MIXED = "mixed"  # both kinds in one step

    @staticmethod
    def of(num_decodes: int, num_prefills: int) -> GraphPhase:
        if num_prefills == 0:
            return GraphPhase.DECODE
        return GraphPhase.PREFILL if num_decodes == 0 else GraphPhase.MIXED


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph is looked up by: the phase and the padded batch size."""

    phase: GraphPhase
    batch_size_bucket: int
