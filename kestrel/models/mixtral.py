"""MixtralForCausalLM: Mistral's attention with mixture-of-experts MLPs (weights renormalised)."""

from __future__ import annotations

from torch import nn

from kestrel.core.weight_bindings import PackedMapping, WeightBindings
from kestrel.layers.moe import expert_mappings
from kestrel.models.dense import DenseDecoderRecipe, decoder_bindings, read_dense_spec
from kestrel.models.spec import DecoderSpec, MoeSpec


class MixtralRecipe(DenseDecoderRecipe):
    architectures = ("MixtralForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        moe = MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
        )
        return read_dense_spec(
            hf_config, "MixtralForCausalLM", sliding_window=getattr(hf_config, "sliding_window", None), moe=moe
        )

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        names = {"w1": "gate", "w3": "up", "w2": "down"}
        experts = expert_mappings(spec.moe.num_experts, "block_sparse_moe", names)
        router = PackedMapping("block_sparse_moe.gate", "mlp.gate", None)
        return decoder_bindings(model, spec, (*experts, router))
