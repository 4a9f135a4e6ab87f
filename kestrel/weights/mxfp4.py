"""MXFP4 checkpoints (`quant_method: "mxfp4"`, GPT-OSS's experts): read as float weights.

A quantized tensor `X` is stored as `X_blocks` [..., rows, groups, 16] of bytes, each holding
two 4-bit e2m1 values (the low nibble first), and `X_scales` [..., rows, groups] of e8m0
exponents (biased by 127): value = e2m1 * 2 ** (scale - 127), 32 values per scale. GPT-OSS
stores each expert projection with rows as output features; the float tensor given to the
bindings is transposed to the layout of the checkpoint's bf16 release ([..., columns, rows]).
Experts run on these float values (no MXFP4 kernel yet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# The 16 values of an e2m1 code, by code: sign bit, then two exponent bits and one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


class Mxfp4CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Mxfp4Config:
    @classmethod
    def from_quantization_config(cls, config: dict[str, Any]) -> Mxfp4Config:
        return cls()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """float32 [..., groups * 32, rows] from blocks [..., rows, groups, 16] and scales [..., rows, groups]."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise Mxfp4CheckpointError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) do not match scales {tuple(scales.shape)}; "
            "expected uint8 blocks [..., rows, groups, 16] and scales [..., rows, groups]"
        )
    table = torch.tensor(E2M1_VALUES)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., rows, groups, 16, 2]
    values = table[codes].flatten(-3)  # [..., rows, groups * 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponents.repeat_interleave(32, dim=-1))
    return values.transpose(-2, -1).contiguous()


def dequantized_tensors(
    names: list[str], read: Callable[[str], torch.Tensor], config: Mxfp4Config
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every `X_blocks` / `X_scales` pair turned into float `X`."""
    present = set(names)
    for name in names:
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in present:
            continue
        if not name.endswith("_blocks"):
            yield name, read(name)
            continue
        base = name.removesuffix("_blocks")
        if f"{base}_scales" not in present:
            raise Mxfp4CheckpointError(f"{name} is MXFP4 but the checkpoint has no {base}_scales")
        yield base, dequantize(read(name), read(f"{base}_scales"), base)
