"""MistralForCausalLM: Llama's layout with sliding-window attention."""

from __future__ import annotations

from kestrel.models.dense import DenseDecoderRecipe, read_dense_spec
from kestrel.models.spec import DecoderSpec


class MistralRecipe(DenseDecoderRecipe):
    architectures = ("MistralForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        return read_dense_spec(
            hf_config, "MistralForCausalLM", sliding_window=getattr(hf_config, "sliding_window", None)
        )
