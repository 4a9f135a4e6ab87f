"""Recipes by Hugging Face architecture name, imported only when asked for."""

from __future__ import annotations

import importlib

from kestrel.core.recipe import ModelRecipe

_RECIPES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "kestrel.models.deepseek:DeepseekV2Recipe",
    "DeepseekV3ForCausalLM": "kestrel.models.deepseek:DeepseekV3Recipe",
    "Gemma3ForCausalLM": "kestrel.models.gemma3:Gemma3Recipe",
    "GptOssForCausalLM": "kestrel.models.gpt_oss:GptOssRecipe",
    "Llama4ForCausalLM": "kestrel.models.llama4:Llama4Recipe",
    "Llama4ForConditionalGeneration": "kestrel.models.llama4:Llama4VisionLanguageRecipe",
    "LlamaForCausalLM": "kestrel.models.llama:LlamaRecipe",
    "MistralForCausalLM": "kestrel.models.mistral:MistralRecipe",
    "MixtralForCausalLM": "kestrel.models.mixtral:MixtralRecipe",
    "Phi3ForCausalLM": "kestrel.models.phi3:Phi3Recipe",
    "Qwen2ForCausalLM": "kestrel.models.qwen2:Qwen2Recipe",
    "Qwen3ForCausalLM": "kestrel.models.qwen3:Qwen3Recipe",
    "Qwen3MoeForCausalLM": "kestrel.models.qwen3_moe:Qwen3MoeRecipe",
    "Qwen3NextForCausalLM": "kestrel.models.qwen3_next:Qwen3NextRecipe",
    "Qwen3_5ForCausalLM": "kestrel.models.qwen3_next:Qwen3_5Recipe",
    "Qwen3_5ForConditionalGeneration": "kestrel.models.qwen3_next:Qwen3_5VisionLanguageRecipe",
    "Qwen3_5MoeForCausalLM": "kestrel.models.qwen3_next:Qwen3_5MoeRecipe",
    "Qwen3_5MoeForConditionalGeneration": "kestrel.models.qwen3_next:Qwen3_5MoeVisionLanguageRecipe",
}


# Architectures whose checkpoints carry multi-token-prediction layers Kestrel runs
# (models/mtp.py; their recipes build and bind the head).
MTP_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


class UnsupportedArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_RECIPES)


def recipe_for(architectures: list[str] | None) -> ModelRecipe:
    for name in architectures or []:
        if name in _RECIPES:
            module_name, class_name = _RECIPES[name].split(":")
            return getattr(importlib.import_module(module_name), class_name)()
    raise UnsupportedArchitectureError(
        f"model architecture {architectures} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def mtp_recipe_for(architectures: list[str] | None) -> ModelRecipe:
    """The recipe of a checkpoint's multi-token-prediction head (speculative decoding's `mtp`)."""
    from kestrel.models.mtp import MtpRecipe

    target = recipe_for(architectures)
    if not any(name in MTP_ARCHITECTURES for name in target.architectures):
        raise UnsupportedArchitectureError(
            f"speculative decoding's 'mtp' method runs the MTP layers of {', '.join(MTP_ARCHITECTURES)} "
            f"checkpoints; {architectures} has none Kestrel can run"
        )
    return MtpRecipe(target)
