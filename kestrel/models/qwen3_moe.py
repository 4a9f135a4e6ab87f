"""Qwen3MoeForCausalLM: Qwen3's attention with mixture-of-experts MLPs."""

from __future__ import annotations

from torch import nn

from kestrel.core.weight_bindings import WeightBindings
from kestrel.layers.moe import EXPERT_PROJECTIONS, expert_mappings
from kestrel.models.dense import DenseDecoderRecipe, decoder_bindings, read_dense_spec, reject_sliding_window_layers
from kestrel.models.spec import DecoderSpec, MoeSpec


def read_qwen_moe(hf_config: object) -> MoeSpec:
    """The routing fields Qwen's MoE configs share (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, whose
    config has no `norm_topk_prob`: it always renormalizes)."""
    return MoeSpec(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
        sparse_step=getattr(hf_config, "decoder_sparse_step", 1) or 1,
        dense_layers=tuple(getattr(hf_config, "mlp_only_layers", None) or ()),
    )


class Qwen3MoeRecipe(DenseDecoderRecipe):
    architectures = ("Qwen3MoeForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        reject_sliding_window_layers(hf_config, "Qwen3-MoE")
        moe = read_qwen_moe(hf_config)
        return read_dense_spec(
            hf_config,
            "Qwen3MoeForCausalLM",
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=True,
            moe=moe,
        )

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return decoder_bindings(model, spec, tuple(expert_mappings(spec.moe.num_experts, "mlp", EXPERT_PROJECTIONS)))
