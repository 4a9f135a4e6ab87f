"""FP8 checkpoints as Hugging Face publishes them (`quantization_config.quant_method: "fp8"`).

Each quantized linear layer stores its weight as float8 e4m3 and a float32 scale beside it:
`weight_scale_inv` with one value per block of `weight_block_size` (DeepSeek-V3, the Qwen3
FP8 releases: [128, 128]), or `weight_scale`, one value for the whole tensor or per output
row. Layers the config leaves out (`modules_to_not_convert`: the LM head, norms, routers) are
plain floats. Activation scales (`input_scale`, the static scheme) belong to float8 matmuls.

This module turns such a checkpoint's tensors into the float weights its names promise, so
every model, device and parallel layout loads it through the usual bindings: each float8
weight is multiplied by its scale (the dequantized reference path). Float8 matmuls that keep
the weights in float8 are a later layer on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


class Fp8CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Fp8Config:
    block_size: tuple[int, int] | None  # rows x columns one weight_scale_inv value covers
    activation_scheme: str  # "dynamic" or "static": only float8 matmuls read it

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any]) -> Fp8Config:
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise Fp8CheckpointError(f"weight_block_size must be two positive sizes, got {block}")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise Fp8CheckpointError(f"unknown FP8 activation_scheme {scheme!r}; expected 'dynamic' or 'static'")
        return cls(tuple(block) if block is not None else None, scheme)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None) -> torch.Tensor:
    """float32 values of a float8 weight [out, in]: a scale per block of `block_size`, or a
    scale for the whole tensor or per output row."""
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return values * scale.reshape(())
    if block_size is None:
        if scale.numel() != weight.shape[0]:
            raise Fp8CheckpointError(
                f"a weight of shape {tuple(weight.shape)} with {scale.numel()} scales and no weight_block_size"
            )
        return values * scale.reshape(-1, 1)
    rows, columns = block_size
    expected = (-(-weight.shape[0] // rows), -(-weight.shape[1] // columns))
    if tuple(scale.shape) != expected:
        raise Fp8CheckpointError(
            f"a weight of shape {tuple(weight.shape)} in blocks of {rows}x{columns} needs scales of shape "
            f"{expected}, got {tuple(scale.shape)}"
        )
    spread = scale.repeat_interleave(rows, 0)[: weight.shape[0]].repeat_interleave(columns, 1)[:, : weight.shape[1]]
    return values * spread


def dequantized_tensors(
    names: list[str], read: Callable[[str], torch.Tensor], config: Fp8Config
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every float8 weight dequantized (in float32: the binding
    casts once, to the model's dtype) and the scales consumed; `read(name)` reads one tensor."""
    present = set(names)
    consumed = {n for n in names if n.endswith(SCALE_SUFFIXES) or n.endswith(".input_scale")}
    for name in names:
        if name in consumed:
            continue
        tensor = read(name)
        if tensor.dtype in FLOAT8_DTYPES:
            module = name.removesuffix("weight")
            scale_name = next((module + s for s in SCALE_SUFFIXES if module + s in present), None)
            if scale_name is None:
                raise Fp8CheckpointError(
                    f"{name} is stored in {tensor.dtype} but the checkpoint has no {module}weight_scale_inv "
                    f"or {module}weight_scale beside it"
                )
            block = config.block_size if scale_name.endswith("weight_scale_inv") else None
            tensor = dequantize(tensor, read(scale_name), block)
        yield name, tensor
