"""AWQ and GPTQ checkpoints (`quantization_config.quant_method: "awq"` / `"gptq"`).

Each quantized linear layer stores, instead of `weight`, integer codes packed into int32
(`qweight`), per-group zero points packed the same way (`qzeros`) and per-group scales
(`scales`, one group per `group_size` input columns); GPTQ may add `g_idx`, each input
column's group (act-order checkpoints permute them). A weight is `scale * (code - zero)`:

- GPTQ (AutoGPTQ's layout, `checkpoint_format` "gptq"): qweight [in / pack, out], codes packed
  along the input dim; qzeros [groups, out / pack] along the output dim, each stored one
  below the zero it means (the format's historical offset; "gptq_v2" stores it as is);
  4 or 8 bits.
- AWQ (`version` "gemm"): qweight [in, out / 8] and qzeros [groups, out / 8], both packed along
  the output dim with the columns of each int32 interleaved (nibble i holds column
  AWQ_ORDER[i]); 4 bits, zero points always.

This module turns such a checkpoint's tensors into the float weights their names promise
(`<module>.weight`, [out, in], in float32: the binding casts once), so every model, device and
parallel layout loads it through the usual bindings (the dequantized reference path). Matmuls
that keep the codes packed are a layer on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ int32 holds
PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


class PackedIntCheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class PackedIntConfig:
    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # input columns per group; -1: one group over all of them
    zero_offset: int  # added to every stored zero point (GPTQ's v1 format: 1)

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any]) -> PackedIntConfig:
        method = config["quant_method"]
        bits = int(config.get("bits", config.get("w_bit", 4)))
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise PackedIntCheckpointError(f"AWQ version {version!r} is not supported; supported: 'gemm'")
            if not config.get("zero_point", True):
                raise PackedIntCheckpointError("AWQ checkpoints without zero points are not supported")
            supported_bits = (4,)
            offset = 0
        else:
            checkpoint_format = config.get("checkpoint_format", "gptq")
            if checkpoint_format not in ("gptq", "gptq_v2"):
                raise PackedIntCheckpointError(
                    f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; supported: 'gptq', 'gptq_v2'"
                )
            supported_bits = (4, 8)
            offset = 1 if checkpoint_format == "gptq" else 0
        if bits not in supported_bits:
            raise PackedIntCheckpointError(
                f"{method.upper()} with {bits} bits is not supported; supported: {supported_bits}"
            )
        if group_size != -1 and group_size < 1:
            raise PackedIntCheckpointError(f"group_size must be positive or -1, got {group_size}")
        return cls(method, bits, group_size, offset)

    @property
    def pack(self) -> int:
        return 32 // self.bits


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [rows, n / pack] -> codes [rows, n], each int32 holding `pack` consecutive
    columns (in `order` where given: element i holds column order[i])."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)  # [rows, n / pack, pack], by element
    if order is not None:
        codes = codes[:, :, list(_inverse(order))]
    return codes.reshape(packed.shape[0], packed.shape[1] * pack)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n / pack, columns] -> codes [n, columns], each int32 holding `pack` consecutive rows."""
    return unpack_columns(packed.t().contiguous(), bits).t()


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    """The element that holds each column."""
    return tuple(order.index(column) for column in range(len(order)))


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    config: PackedIntConfig,
    what: str,
) -> torch.Tensor:
    """The float32 weight [out, in] of one layer's packed tensors."""
    if config.method == "awq":
        codes = unpack_columns(qweight, config.bits, AWQ_ORDER)  # [in, out]
        zeros = unpack_columns(qzeros, config.bits, AWQ_ORDER)
    else:
        codes = unpack_rows(qweight, config.bits)  # [in, out]
        zeros = unpack_columns(qzeros, config.bits)
    in_features, out_features = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != out_features or zeros.shape != scales.shape:
        raise PackedIntCheckpointError(
            f"{what}: qweight holds {in_features} x {out_features} codes but scales are {tuple(scales.shape)} "
            f"and qzeros hold {tuple(zeros.shape)}"
        )
    if g_idx is None:
        group_size = in_features if config.group_size == -1 else config.group_size
        g_idx = torch.arange(in_features) // group_size
    if g_idx.shape != (in_features,) or int(g_idx.max()) >= groups:
        raise PackedIntCheckpointError(
            f"{what}: {groups} groups of scales do not cover its {in_features} input columns"
        )
    g_idx = g_idx.long()
    scale = scales.float()[g_idx]  # [in, out]
    zero = (zeros + config.zero_offset).float()[g_idx]
    return ((codes.float() - zero) * scale).t().contiguous()


def dequantized_tensors(
    names: list[str], read: Callable[[str], torch.Tensor], config: PackedIntConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every packed layer turned into its float `weight`, and
    the packed pieces consumed; `read(name)` reads one tensor."""
    present = set(names)
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in ("qzeros", "scales", "g_idx") and f"{module}.qweight" in present:
            continue
        if suffix != "qweight":
            yield name, read(name)
            continue
        missing = [f"{module}.{part}" for part in ("qzeros", "scales") if f"{module}.{part}" not in present]
        if missing:
            raise PackedIntCheckpointError(f"{name} is packed but the checkpoint has no {' or '.join(missing)}")
        g_idx = read(f"{module}.g_idx") if f"{module}.g_idx" in present else None
        weight = dequantize(read(name), read(f"{module}.qzeros"), read(f"{module}.scales"), g_idx, config, module)
        yield f"{module}.weight", weight
