"""Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4 and Phi-4-mini text): Llama's layout with q, k and v
in one checkpoint tensor and gate and up in another, LongRoPE scaling, a partial rotary dim
(Phi-4-mini) and an optional sliding window."""

from __future__ import annotations

from kestrel.models.dense import DenseDecoderRecipe, read_dense_spec, read_rope
from kestrel.models.spec import DecoderSpec


class Phi3Recipe(DenseDecoderRecipe):
    architectures = ("Phi3ForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        rope_params = dict(getattr(hf_config, "rope_parameters", None) or {})
        partial = rope_params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        return read_dense_spec(
            hf_config,
            "Phi3ForCausalLM",
            rope=read_rope(hf_config, allow_partial=True),
            partial_rotary_factor=float(partial),
            sliding_window=getattr(hf_config, "sliding_window", None),
            fused_projections=True,
        )
