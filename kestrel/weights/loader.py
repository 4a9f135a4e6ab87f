"""Build a recipe's module on the meta device, then fill it from safetensors or with dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.recipe import ModelRecipe, ModelSpec

INDEX_FILE = "model.safetensors.index.json"


class MissingWeightsError(FileNotFoundError):
    pass


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the sharded index's files, or every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise MissingWeightsError(f"{INDEX_FILE} in {model_dir} names missing files: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise MissingWeightsError(
            f"no *.safetensors weights in {model_dir}; Kestrel loads safetensors checkpoints "
            "(or use load_format='dummy' for random weights)"
        )
    return files


def build_empty(
    recipe: ModelRecipe, spec: ModelSpec, device: torch.device, dtype: torch.dtype, parallel: TensorParallel = SINGLE
) -> nn.Module:
    # The meta device records shapes without allocating or initialising anything.
    with torch.device("meta"):
        model = recipe.build(spec, parallel).to(dtype)
    return model.to_empty(device=device).eval()


def load_checkpoint(model: nn.Module, recipe: ModelRecipe, spec: ModelSpec, model_dir: Path) -> None:
    bindings = recipe.bindings(model, spec)
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                bindings.bind(name, shard.get_tensor(name))
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
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
    seed: int,
    parallel: TensorParallel = SINGLE,
) -> nn.Module:
    model = build_empty(recipe, spec, device, dtype, parallel)
    if load_format == "dummy":
        fill_dummy(model, seed)
    elif load_format in ("auto", "safetensors"):
        load_checkpoint(model, recipe, spec, model_dir)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; expected 'auto', 'safetensors' or 'dummy'")
    return model
