"""Qwen3NextForCausalLM and Qwen3_5ForCausalLM: hybrid stacks of gated DeltaNet and gated
full-attention layers (Qwen3-Next with mixture-of-experts MLPs, Qwen3.5 text with dense ones)."""

from __future__ import annotations

from torch import nn

from kestrel.core.bindings import PackedMapping, WeightBindings
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.recipe import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionSpec, ModelSpec
from kestrel.layers.moe import expert_mappings
from kestrel.models.dense import read_dense_spec, read_rope
from kestrel.models.hybrid import HybridForCausalLM, hybrid_bindings
from kestrel.models.qwen3_moe import read_qwen_moe


def read_hybrid_spec(hf_config: object, architecture: str, grouped_projection: bool, **family: object) -> ModelSpec:
    layer_types = tuple(hf_config.layer_types)
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in a {architecture} config")
    linear = LinearAttentionSpec(
        num_key_heads=hf_config.linear_num_key_heads,
        num_value_heads=hf_config.linear_num_value_heads,
        key_head_dim=hf_config.linear_key_head_dim,
        value_head_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
        grouped_projection=grouped_projection,
    )
    rope_params = getattr(hf_config, "rope_parameters", None) or {}
    partial = rope_params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return read_dense_spec(
        hf_config,
        architecture,
        rope=read_rope(hf_config, allow_partial=True),
        layer_types=layer_types,
        linear_attention=linear,
        partial_rotary_factor=float(partial),
        attention_output_gate=True,
        **family,
    )


class HybridRecipe:
    architectures: tuple[str, ...] = ()

    def build(self, spec: ModelSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return HybridForCausalLM(spec, parallel)

    def bindings(self, model: nn.Module, spec: ModelSpec) -> WeightBindings:
        return hybrid_bindings(model, spec)


class Qwen3NextRecipe(HybridRecipe):
    architectures = ("Qwen3NextForCausalLM",)

    def spec(self, hf_config: object) -> ModelSpec:
        moe = read_qwen_moe(hf_config) if getattr(hf_config, "num_experts", 0) else None
        return read_hybrid_spec(
            hf_config,
            "Qwen3NextForCausalLM",
            grouped_projection=True,
            moe=moe,
            shared_expert_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
        )

    def bindings(self, model: nn.Module, spec: ModelSpec) -> WeightBindings:
        names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
        experts: tuple[PackedMapping, ...] = ()
        if spec.moe is not None:
            experts = tuple(expert_mappings(spec.moe.num_experts, "mlp", names))
        return hybrid_bindings(model, spec, experts)


class Qwen3_5Recipe(HybridRecipe):
    architectures = ("Qwen3_5ForCausalLM",)

    def spec(self, hf_config: object) -> ModelSpec:
        return read_hybrid_spec(hf_config, "Qwen3_5ForCausalLM", grouped_projection=False)
