"""Build a recipe's module on the meta device, then fill it from a checkpoint or with dummy weights."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.recipe import ModelRecipe, ModelSpec
from kestrel.weights.checkpoint import Checkpoint

LOAD_FORMATS = ("auto", "safetensors", "gguf")


def build_empty(
    recipe: ModelRecipe, spec: ModelSpec, device: torch.device, dtype: torch.dtype, parallel: TensorParallel = SINGLE
) -> nn.Module:
    # The meta device records shapes without allocating or initialising anything.
    with torch.device("meta"):
        model = recipe.build(spec, parallel).to(dtype)
    return model.to_empty(device=device).eval()


def load_checkpoint(model: nn.Module, recipe: ModelRecipe, spec: ModelSpec, checkpoint: Checkpoint) -> None:
    bindings = recipe.bindings(model, spec)
    for name, tensor in checkpoint.tensors():
        bindings.bind(name, tensor)
    bindings.finish()


def fill_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes, scaled so activations stay finite in any dtype."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])


def load_model(
    recipe: ModelRecipe,
    spec: ModelSpec,
    checkpoint: Checkpoint | None,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
    seed: int,
    parallel: TensorParallel = SINGLE,
) -> nn.Module:
    model = build_empty(recipe, spec, device, dtype, parallel)
    if load_format == "dummy":
        fill_dummy(model, seed)
    elif load_format in LOAD_FORMATS and checkpoint is not None:
        load_checkpoint(model, recipe, spec, checkpoint)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)} or 'dummy'")
    weights_loaded(model)
    return model


def weights_loaded(model: nn.Module) -> None:
    """Let each module derive, once, what it computes from its loaded weights (a module
    that does declares `after_weights_loaded`)."""
    for module in model.modules():
        hook = getattr(module, "after_weights_loaded", None)
        if hook is not None:
            hook()
