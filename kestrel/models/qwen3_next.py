"""Qwen3-Next and Qwen3.5: hybrid stacks of gated DeltaNet and gated full-attention layers,
with mixture-of-experts MLPs (Qwen3-Next, Qwen3.5-MoE) or dense ones (Qwen3.5).

Qwen3.5 releases are `...ForConditionalGeneration` checkpoints, a vision tower beside the text
model; Kestrel serves the text model from them and skips the vision weights."""

from __future__ import annotations

from torch import nn

from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import PackedMapping, SkippedPrefix, WeightBindings
from kestrel.layers.moe import EXPERT_PROJECTIONS, expert_mappings, stacked_target
from kestrel.models.dense import read_dense_spec, read_rope
from kestrel.models.hybrid import HybridForCausalLM, hybrid_bindings
from kestrel.models.qwen3_moe import read_qwen_moe
from kestrel.models.spec import FULL_ATTENTION, LINEAR_ATTENTION, DecoderSpec, LinearAttentionSpec


def read_hybrid_spec(hf_config: object, architecture: str, grouped_projection: bool, **family: object) -> DecoderSpec:
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

    def build(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return HybridForCausalLM(spec, parallel)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return hybrid_bindings(model, spec)

    def build_mtp(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        """The `mtp.*` head as speculative decoding's draft (models/mtp.py)."""
        from kestrel.models.mtp import MtpForCausalLM

        return MtpForCausalLM(spec, parallel)

    def mtp_bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        from kestrel.models.mtp import qwen_mtp_bindings

        return qwen_mtp_bindings(self, model, spec)


VISION_TOWER = SkippedPrefix("model.visual.", "the vision tower (Kestrel serves the text model)")
LANGUAGE_MODEL = {"model.language_model.": "model."}


def read_hybrid_moe_spec(hf_config: object, architecture: str, grouped_projection: bool) -> DecoderSpec:
    moe = read_qwen_moe(hf_config) if getattr(hf_config, "num_experts", 0) else None
    return read_hybrid_spec(
        hf_config,
        architecture,
        grouped_projection=grouped_projection,
        moe=moe,
        shared_expert_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
    )


class Qwen3NextRecipe(HybridRecipe):
    architectures = ("Qwen3NextForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        return read_hybrid_moe_spec(hf_config, "Qwen3NextForCausalLM", grouped_projection=True)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return hybrid_bindings(model, spec, self._expert_mappings(spec))

    @staticmethod
    def _expert_mappings(spec: DecoderSpec) -> tuple[PackedMapping, ...]:
        if spec.moe is None:
            return ()
        mappings = expert_mappings(spec.moe.num_experts, "mlp", EXPERT_PROJECTIONS)
        if spec.shared_expert_size:  # the shared expert's gate is the router's last row
            mappings.append(PackedMapping("shared_expert_gate", "gate", "shared"))
        if spec.stacks_shared_expert:  # the shared expert is stacked last (SharedExpertMoe)
            shared = spec.moe.num_experts
            for name, part in EXPERT_PROJECTIONS.items():
                mappings.append(PackedMapping(f"mlp.shared_expert.{name}", stacked_target(part), f"{shared}:{part}"))
        return tuple(mappings)


class Qwen3_5Recipe(HybridRecipe):
    architectures = ("Qwen3_5ForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        return read_hybrid_spec(hf_config, "Qwen3_5ForCausalLM", grouped_projection=False)


class Qwen3_5MoeRecipe(Qwen3NextRecipe):
    architectures = ("Qwen3_5MoeForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        return read_hybrid_moe_spec(hf_config, "Qwen3_5MoeForCausalLM", grouped_projection=False)


class Qwen3_5VisionLanguageRecipe(Qwen3_5Recipe):
    """A Qwen3.5 release: its `text_config` and `model.language_model.*` weights."""

    architectures = ("Qwen3_5ForConditionalGeneration",)

    def spec(self, hf_config: object) -> DecoderSpec:
        return super().spec(text_config(hf_config))

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return hybrid_bindings(model, spec, (), (VISION_TOWER,), LANGUAGE_MODEL)


class Qwen3_5MoeVisionLanguageRecipe(Qwen3_5MoeRecipe):
    """A Qwen3.5-MoE release: its `text_config` and `model.language_model.*` weights."""

    architectures = ("Qwen3_5MoeForConditionalGeneration",)

    def spec(self, hf_config: object) -> DecoderSpec:
        return super().spec(text_config(hf_config))

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return hybrid_bindings(model, spec, self._expert_mappings(spec), (VISION_TOWER,), LANGUAGE_MODEL)


def text_config(hf_config: object) -> object:
    config = getattr(hf_config, "text_config", None)
    if config is None:
        raise ValueError("a vision-language Qwen3.5 config has no text_config")
    return config
