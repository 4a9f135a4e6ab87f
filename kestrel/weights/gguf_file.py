"""Read a GGUF file: its metadata and its tensors, dequantized to torch tensors.

The `gguf` package supplies the format's constants and the numpy dequantizers. Its
`GGUFReader` parses a 49k-entry vocabulary one numpy view per string (about 11 s for
SmolLM2-135M), so the file's structure is parsed here, with plain `struct` reads (0.1 s).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one value (strings and arrays are read apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32}
_NUMPY_DTYPES.update({7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64})
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, as torch sees it (GGUF lists the innermost dim first)
    quant_type: GGMLQuantizationType
    offset: int  # bytes from the start of the file

    @property
    def num_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.quant_type]
        return int(np.prod(self.shape)) // block_size * type_size


class _Cursor:
    """Little-endian reads from a memory map, advancing an offset."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.offset
        self.offset += length
        return bytes(self.buffer[start : self.offset]).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALAR_FORMATS:
            raise GgufFormatError(f"unknown GGUF metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])

    def array(self) -> list[Any]:
        item_type = self.scalar("I")
        count = self.scalar("Q")
        if item_type in _NUMPY_DTYPES:  # numbers in one read, not one struct call each
            dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
            self.offset += values.nbytes
            return values.tolist()
        return [self.value(item_type) for _ in range(count)]


class GgufFile:
    """One GGUF file, memory-mapped: `metadata` holds every key, `tensors` every tensor's place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Copy-on-write: torch wants writable buffers; nothing is ever written back.
        self._data = np.memmap(path, dtype=np.uint8, mode="c")
        cursor = _Cursor(memoryview(self._data))
        if bytes(self._data[:4]) != GGUF_MAGIC:
            raise GgufFormatError(f"{path} is not a GGUF file (no GGUF magic number)")
        cursor.offset = 4
        version = cursor.scalar("I")
        if version < 2:
            raise GgufFormatError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
        num_tensors, num_keys = cursor.scalar("Q"), cursor.scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_keys):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("I"))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.offset // alignment) * alignment
        self.tensors = {
            info.name: GgufTensorInfo(info.name, info.shape, info.quant_type, data_start + info.offset)
            for info in infos
        }

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> GgufTensorInfo:
        name = cursor.string()
        dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
        type_id = cursor.scalar("I")
        try:
            quant_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GgufFormatError(f"tensor {name} has unknown GGML type {type_id}") from None
        return GgufTensorInfo(name, tuple(reversed(dims)), quant_type, cursor.scalar("Q"))

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A key of this architecture's namespace: `llama.block_count` for "block_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized: float32 for quantized blocks, the stored dtype otherwise."""
        info = self.tensors[name]
        raw = self._data[info.offset : info.offset + info.num_bytes]
        return dequantize(raw, info)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensors:
            yield name, self.tensor(name)


_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
    GGMLQuantizationType.F64: torch.float64,
}


def dequantize(raw: np.ndarray, info: GgufTensorInfo) -> torch.Tensor:
    if info.quant_type in _PLAIN_DTYPES:
        return torch.from_numpy(np.asarray(raw)).view(_PLAIN_DTYPES[info.quant_type]).view(info.shape)
    if info.quant_type in _TORCH_DEQUANTIZERS:
        return _TORCH_DEQUANTIZERS[info.quant_type](torch.from_numpy(np.asarray(raw))).view(info.shape)
    try:
        values = quants.dequantize(np.asarray(raw), info.quant_type)
    except NotImplementedError:
        raise GgufFormatError(f"tensor {info.name}: GGML type {info.quant_type.name} cannot be dequantized") from None
    return torch.from_numpy(values.reshape(info.shape))


# The block formats of most published GGUF files, in torch: 0.85 s for SmolLM2-135M's Q4_1 and
# Q8_0 tensors on 2 cores, against 2.2 s with `gguf.quants`;
# 32 values a block, a float16 scale `d` (and for Q4_1 a float16 minimum `m`) before the quants.


def _block_halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 34)
    scale = _block_halves(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * scale


def _nibbles(quants_bytes: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: the low nibbles are values 0-15, the high nibbles 16-31."""
    return torch.cat([quants_bytes & 0x0F, quants_bytes >> 4], dim=1).float()


def _dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)
    return (_nibbles(blocks[:, 2:]) - 8.0) * _block_halves(blocks, 0)


def _dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)
    return _nibbles(blocks[:, 4:]) * _block_halves(blocks, 0) + _block_halves(blocks, 2)


_TORCH_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}
