"""Quantized linears, applied after loading (`--quantization`): `int4` and `fp8`.

`int4`: weight-only, the decoder's projections kept as 4-bit integers in groups along the
input dim, each group with its own scale and zero (w = (q - 8) * scale + zero). On the CPU,
groups of 32, read at one row by Kestrel's AVX-512 VNNI matvec where the CPU has it
(layers/int4_cpu.py), else by torch's `_weight_int4pack_mm_for_cpu`; on CUDA, groups of 128
(as AWQ and GPTQ checkpoints use) read by Triton kernels that widen the codes in registers
(layers/int4_matmul.py).

The LM head stays as loaded: an 8-bit copy with a scale per row (`_weight_int8pack_mm`) read a
quarter of the bytes, but moved the demo model's logprobs 0.03 nats on average and changed its
first answer; a bfloat16 copy was no faster than float32 on this CPU.

A one-row CPU linear reads its weight once per step, so the step's time is the weight's bytes
over memory bandwidth: 4-bit weights read an eighth of float32's bytes (measured on a 2-core
Xeon: a 1536 x 576 matvec 219 us in float32, 46 us in 4-bit). The kernel computes in bfloat16
(its float32 variant is many times slower), so activations are rounded to bfloat16 on the way
in and the output cast back to the model's dtype. The VNNI kernel holds activations as
integers of about 14 bits per group of 32 instead, closer to float32 than bfloat16 is.

Weights are quantized after loading, from the bound float weights (round to nearest, each
group's minimum and maximum spanning 0..15: the GGUF Q4_1 recipe), so any checkpoint can be
run this way. A GGUF checkpoint stored in Q4_1 comes back to its own 4-bit codes, since its
dequantized groups already lie on such a grid; only the scales and zeros are rounded to bfloat16.

`fp8` (vLLM's online FP8): each projection's weight in float8 e4m3 with a float32 scale per
output row (its largest magnitude maps to 448), activations quantized per token at run
time. On CUDA the matmuls run on the float8 tensor cores (layers/fp8_matmul.py); elsewhere
the same arithmetic is emulated in the model's dtype (the reference path the CPU suite
checks): activations rounded through e4m3 per row, times the dequantized weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.kernel_branches import runs_kernels
from kestrel.core.runtime import cpu_kernels
from kestrel.layers import int4_cpu

logger = logging.getLogger("kestrel")

INT4 = "int4"
GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16  # the kernel's fast path; scales and zeros are stored in it too
_ZERO_POINT = 8  # the kernel subtracts it from every code
_ROW_TILE = 16  # the kernel's packing takes output rows 16 at a time
# From this many rows the 4-bit kernel is bound by its arithmetic (about 40 GFLOP/s on a 2-core
# Xeon at any row count), and a bfloat16 matmul on the same weight is faster: 3072 x 576 at 32
# rows, 2.8 ms against 0.29 ms with AMX; at 16 rows they are about even with float32's.
WIDE_MIN_ROWS = 16
# Whether oneDNN has bfloat16 matmuls on this CPU (AVX-512 BF16 or AMX); elsewhere a bfloat16
# matmul is slower than the 4-bit kernel, so no copy is kept.
_BF16_MATMULS = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class Int4Weight:
    """A [out_features, in_features] weight, packed for `_weight_int4pack_mm_for_cpu`; with, where
    the CPU has bfloat16 matmuls, the same 4-bit values widened to bfloat16 for steps of many
    rows (prefill, large decode batches): 2.5 bytes a weight in all instead of float32's 4."""

    packed: torch.Tensor  # uint8, the kernel's own layout
    scales_and_zeros: torch.Tensor  # [in_features / group_size, out_features, 2], COMPUTE_DTYPE
    out_features: int
    in_features: int
    group_size: int = GROUP_SIZE
    wide: torch.Tensor | None = None  # [out_features, in_features] COMPUTE_DTYPE, or None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear(x, self, bias)

    @property
    def narrow_bytes(self) -> int:
        """What a step of fewer than WIDE_MIN_ROWS rows reads."""
        return _bytes(self.packed) + _bytes(self.scales_and_zeros)

    def tensors(self) -> dict[str, torch.Tensor]:
        wide = {"wide": self.wide} if self.wide is not None else {}
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros} | wide


@dataclass(frozen=True)
class Int4VnniWeight:
    """The same 4-bit values in the layout of Kestrel's AVX-512 VNNI matvec (layers/int4_cpu.py),
    which reads them 1.6-1.9x as fast as torch's kernel at one row (slower from 4 rows); with the
    bfloat16 copy for steps of many rows as `Int4Weight` has."""

    codes: torch.Tensor  # uint8 [out_features, in_features / 2]
    scales_and_zeros: torch.Tensor  # bfloat16 [2, out_features, in_features / group_size]
    out_features: int
    in_features: int
    group_size: int = GROUP_SIZE
    wide: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def narrow_bytes(self) -> int:
        return _bytes(self.codes) + _bytes(self.scales_and_zeros)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear(x, self, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        wide = {"wide": self.wide} if self.wide is not None else {}
        return {"codes": self.codes, "scales_and_zeros": self.scales_and_zeros} | wide


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


CUDA_GROUP_SIZE = 128


@dataclass(frozen=True)
class Int4CudaWeight:
    """A [out_features, in_features] weight as 4-bit codes for the CUDA kernels: codes [out,
    in / 8] int32 (nibble i of word j: input column 8j + i), scales and zeros [out, in / group]
    in the model's dtype."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int = CUDA_GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 8)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from kestrel.layers.int4_matmul import int4_linear_cuda

        return int4_linear_cuda(x, self.codes, self.scales, self.zeros, self.group_size, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "zeros": self.zeros}


def int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes [out, groups, group] per group of `group_size` input
    columns, each group's minimum and maximum spanning 0..15 (the GGUF Q4_1 recipe), with its
    scale and zero [out, groups] rounded to bfloat16 first and each code chosen against them."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).to(COMPUTE_DTYPE).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
    zero = (low + _ZERO_POINT * scale).to(COMPUTE_DTYPE).float()
    codes = ((groups - zero[..., None]) / scale[..., None] + _ZERO_POINT).round().clamp(0, 15)
    return codes, scale, zero


def quantize_int4_cuda(weight: torch.Tensor, group_size: int = CUDA_GROUP_SIZE) -> Int4CudaWeight:
    """`Int4CudaWeight` of a float weight (on any device: the kernels' tests run it on the CPU)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 weights on CUDA need in_features divisible by {group_size}, got {in_features}")
    codes, scale, zero = int4_groups(weight, group_size)
    nibbles = codes.reshape(out_features, in_features // 8, 8).to(torch.int64)
    words = (nibbles << (4 * torch.arange(8, device=weight.device))).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed
    return Int4CudaWeight(words.contiguous(), scale.to(weight.dtype), zero.to(weight.dtype), group_size)


def dequantize_int4_cuda(weight: Int4CudaWeight) -> torch.Tensor:
    """The float32 weight the CUDA kernels multiply by: the reference their tests compare with."""
    shifts = 4 * torch.arange(8, device=weight.codes.device)
    codes = ((weight.codes[..., None].to(torch.int64) >> shifts) & 0xF).flatten(1).float()
    groups = codes.unflatten(1, (-1, weight.group_size))
    return ((groups - _ZERO_POINT) * weight.scales.float()[..., None] + weight.zeros.float()[..., None]).flatten(1)


FP8 = "fp8"
E4M3_MAX = 448.0
FP8_MIN_SCALE = 1e-12  # a row of zeros still gets a usable scale
# Steps of up to this many rows read each float8 weight once and multiply the activations as
# they are (W8A16: layers/fp8_matmul.py); larger steps round them to e4m3 per row (W8A8).
FP8_FEW_ROWS = 16


@dataclass(frozen=True)
class Fp8Weight:
    """A [out_features, in_features] weight as float8 e4m3 values and a float32 scale per row;
    off CUDA also `reference`, the dequantized values in the model's dtype."""

    values: torch.Tensor  # float8_e4m3fn [out, in]
    scales: torch.Tensor  # float32 [out]
    reference: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if runs_kernels(x):
            from kestrel.layers.fp8_matmul import fp8_linear

            return fp8_linear(x, self.values, self.scales, bias)
        activations = x if x.shape[0] <= FP8_FEW_ROWS else round_rows_through_fp8(x)
        return F.linear(activations, self.reference, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        reference = {"reference": self.reference} if self.reference is not None else {}
        return {"values": self.values, "scales": self.scales} | reference


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Per output row: scale = max|w| / 448, values = w / scale rounded to e4m3."""
    rows = weight.detach().float()
    scales = (rows.abs().amax(dim=1) / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    values = (rows / scales[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    reference = None if runs_kernels(weight) else (values.float() * scales[:, None]).to(weight.dtype)
    return Fp8Weight(values, scales, reference)


def round_rows_through_fp8(x: torch.Tensor) -> torch.Tensor:
    """What the float8 matmul multiplies for activations x [rows, K]: each row scaled to
    e4m3's range, rounded to e4m3, scaled back (layers/fp8_matmul.quantize_rows)."""
    x32 = x.float()
    scales = (x32.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    rounded = (x32 / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (rounded * scales).to(x.dtype)


PackedWeight = Int4Weight | Int4VnniWeight | Int4CudaWeight | Fp8Weight  # the union of every packed format
QUANTIZATIONS = (INT4, FP8)


def register_packed(module: nn.Module, prefix: str, weight: PackedWeight) -> None:
    """Keep `weight`'s tensors as (frozen) parameters of `module`, so that whatever counts a
    model's weight bytes counts the packed ones."""
    for name, tensor in weight.tensors().items():
        module.register_parameter(f"{prefix}_{name}", nn.Parameter(tensor, requires_grad=False))


def packable(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    """Whether the kernel takes this shape: whole groups, and rows in its tiles of 16."""
    return in_features % group_size == 0 and out_features % _ROW_TILE == 0


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight | Int4VnniWeight:
    """Round-to-nearest 4-bit codes per group of `group_size` input columns, in the layout of
    Kestrel's VNNI kernel where this CPU runs it and the shape fits, else torch's."""
    out_features, in_features = weight.shape
    if not packable(out_features, in_features, group_size):
        raise ValueError(
            f"int4 weights need in_features divisible by {group_size} and out_features by {_ROW_TILE}, "
            f"got {out_features} x {in_features}"
        )
    codes, scale, zero = int4_groups(weight, group_size)
    wide = None
    if _BF16_MATMULS:
        wide = ((codes - _ZERO_POINT) * scale[..., None] + zero[..., None]).reshape(out_features, in_features)
        wide = wide.to(COMPUTE_DTYPE)
    codes = codes.reshape(out_features, in_features)
    if group_size == int4_cpu.GROUP_SIZE and int4_cpu.fits(out_features, in_features) and cpu_kernels.available():
        vnni_codes, vnni_scales_and_zeros = int4_cpu.pack(codes, scale, zero)
        return Int4VnniWeight(vnni_codes, vnni_scales_and_zeros, out_features, in_features, group_size, wide)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(COMPUTE_DTYPE).contiguous()
    return Int4Weight(packed, scales_and_zeros, out_features, in_features, group_size, wide)


def int4_linear(x: torch.Tensor, weight: Int4Weight | Int4VnniWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for 2-D `x`, returned in x's dtype: in bfloat16 by torch's kernel or
    the bfloat16 copy, with two-digit int8 activations by the VNNI kernel."""
    if weight.wide is not None and x.shape[0] >= WIDE_MIN_ROWS:
        out = F.linear(x.to(COMPUTE_DTYPE), weight.wide).to(x.dtype)
    elif isinstance(weight, Int4VnniWeight):
        out = int4_cpu.matvec(x.float(), weight.codes, weight.scales_and_zeros).to(x.dtype)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(COMPUTE_DTYPE), weight.packed, weight.group_size, weight.scales_and_zeros
        ).to(x.dtype)
    return out if bias is None else out + bias


def dequantize_int4(weight: Int4Weight | Int4VnniWeight) -> torch.Tensor:
    """The weight the 4-bit kernel multiplies by (torch's read back through it, rounded to
    bfloat16): the reference its tests compare with."""
    if isinstance(weight, Int4VnniWeight):
        return int4_cpu.dequantize(weight.codes, weight.scales_and_zeros)
    eye = torch.eye(weight.in_features, dtype=COMPUTE_DTYPE)
    return (
        torch.ops.aten._weight_int4pack_mm_for_cpu(eye, weight.packed, weight.group_size, weight.scales_and_zeros)
        .float()
        .t()
    )


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the float weight of every decoder projection (a `Linear` marked quantizable,
    of a shape the kernel takes) by its packed form, and with "fp8" every MoE layer's stacked
    experts too; returns how many weights. Routers, embeddings and the LM head stay as loaded."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")
    from kestrel.layers.linear import Linear
    from kestrel.layers.moe import SparseMoe

    kernels = runs_kernels(next(model.parameters()))
    takes = fp8_packable if method == FP8 else (int4_cuda_packable if kernels else packable)
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantizable and takes(module.out_features, module.in_features):
            module.quantize(method)
            count += 1
        elif isinstance(module, SparseMoe) and method == FP8:  # experts: float8 rows, bf16 activations
            module.quantize(method)
            count += 2
    return count


def int4_cuda_packable(out_features: int, in_features: int) -> bool:
    """The CUDA kernels take whole groups of 128 inputs."""
    return in_features % CUDA_GROUP_SIZE == 0


def fp8_packable(out_features: int, in_features: int) -> bool:
    """The float8 matmul takes both dims in multiples of 16."""
    return out_features % 16 == 0 and in_features % 16 == 0
