"""Qwen3ForCausalLM: RMSNorm on each query and key head, explicit head_dim."""

from __future__ import annotations

from kestrel.models.dense import DenseDecoderRecipe, read_dense_spec, reject_sliding_window_layers
from kestrel.models.spec import DecoderSpec


class Qwen3Recipe(DenseDecoderRecipe):
    architectures = ("Qwen3ForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        reject_sliding_window_layers(hf_config, "Qwen3")
        return read_dense_spec(
            hf_config,
            "Qwen3ForCausalLM",
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=True,
        )
