"""LlamaForCausalLM (Llama 2 and 3, including llama3 rope scaling)."""

from __future__ import annotations

from kestrel.models.dense import DenseDecoderRecipe, read_dense_spec
from kestrel.models.spec import DecoderSpec


class LlamaRecipe(DenseDecoderRecipe):
    architectures = ("LlamaForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("Llama checkpoints with mlp_bias=true are not supported")
        return read_dense_spec(
            hf_config, "LlamaForCausalLM", attention_bias=bool(getattr(hf_config, "attention_bias", False))
        )
