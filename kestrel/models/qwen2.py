"""Qwen2ForCausalLM: bias on the q, k and v projections."""

from __future__ import annotations

from kestrel.models.dense import DenseDecoderRecipe, read_dense_spec, reject_sliding_window_layers
from kestrel.models.spec import DecoderSpec


class Qwen2Recipe(DenseDecoderRecipe):
    architectures = ("Qwen2ForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        reject_sliding_window_layers(hf_config, "Qwen2")
        return read_dense_spec(hf_config, "Qwen2ForCausalLM", attention_bias=True)
