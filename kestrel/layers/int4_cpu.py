"""Kestrel's 4-bit matvec for CPUs with AVX-512 VNNI (core/runtime/cpu_kernels.cpp), built on first use.

torch's `_weight_int4pack_mm_for_cpu` widens every code to bfloat16 before it multiplies and
streams its weight without prefetching; on a 2-core Xeon it reads 10-13 GB/s of codes where the
machine copies 27-31. This kernel holds each activation as an integer of two int8 digits per
group of 32 (about 14 bits of the group's largest value), multiplies 64 codes by 64 activations
with two vpdpbusd (one per digit), and prefetches the codes a few rows ahead: the demo model's 120 decoder matvecs
take 3.0 ms against torch's 4.9-5.8 (scripts/int4_cpu_bench.py), and its activations are held
closer to float32 than torch's bfloat16 ones.

Where the kernels cannot run (core/runtime/cpu_kernels.py) the 4-bit weights stay in torch's
layout and kernel.
"""

from __future__ import annotations

import torch

from kestrel.core.runtime import cpu_kernels

GROUP_SIZE = 32
BLOCK = 128  # columns per packed block (a last block may hold 64)
ROWS_AT_ONCE = 4  # output rows the kernel computes together
_LARGEST = 127 * 128  # an activation group's largest magnitude, as an integer (two int8 digits)


def fits(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes this shape: whole blocks of 64 columns, rows by fours."""
    return in_features % 64 == 0 and out_features % ROWS_AT_ONCE == 0


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of codes [out, in] (0..15) and scale, zero [out, groups]: codes
    uint8 [out, in / 2] (per 128 columns, byte j holds column j low and 64 + j high; a last 64
    columns, j and 32 + j) and the scales then the zeros, bfloat16 [2, out, groups]."""
    out_features, in_features = codes.shape
    codes = codes.to(torch.uint8)
    blocks = []
    for start in range(0, in_features, BLOCK):
        half = min(BLOCK, in_features - start) // 2
        blocks.append(codes[:, start : start + half] | (codes[:, start + half : start + 2 * half] << 4))
    scales_and_zeros = torch.stack((scale, zero)).to(torch.bfloat16).contiguous()
    return torch.cat(blocks, dim=1).contiguous(), scales_and_zeros


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes [out, in] (int64) that `pack` packed."""
    blocks = []
    for start in range(0, packed.shape[1], BLOCK // 2):
        block = packed[:, start : start + BLOCK // 2].to(torch.int64)
        blocks += [block & 15, block >> 4]
    return torch.cat(blocks, dim=1)


def matvec(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times the packed weight: [rows, out] float32."""
    return cpu_kernels.ops().int4_matvec(x, codes, scales_and_zeros)


def reference(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch: x rounded per group of 32 to integers whose largest
    magnitude is 127 * 128 (two int8 digits; ties to even) times each code's scale, plus each
    group's zero - 8 * scale times the group's exact sum of x."""
    rows, in_features = x.shape
    groups = x.float().reshape(rows, in_features // GROUP_SIZE, GROUP_SIZE)
    step = groups.abs().amax(-1, keepdim=True) / _LARGEST
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    rounded = ((groups * inverse).round() * step).reshape(rows, in_features)
    values = unpack(codes).float()
    scale, zero = scales_and_zeros.float()
    scaled = (values.reshape(*scale.shape, GROUP_SIZE) * scale[..., None]).reshape(values.shape)
    return rounded @ scaled.t() + groups.sum(-1) @ (zero - 8 * scale).t()


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in]: (code - 8) * scale + zero per group."""
    values = unpack(codes).float()
    out_features, in_features = values.shape
    scale, zero = scales_and_zeros.float()
    grouped = values.reshape(out_features, -1, GROUP_SIZE)
    return ((grouped - 8) * scale[..., None] + zero[..., None]).reshape(out_features, in_features)
