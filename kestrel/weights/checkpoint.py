"""Checkpoint: where a model's config, weights and tokenizer come from.

`open_checkpoint(model)` resolves what a user typed (a checkpoint directory, a `.gguf` file,
a directory holding one, or a Hugging Face model id found in the local cache) into one of two
implementations of the same small contract, so the rest of the engine never asks which
format it loads.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import ExitStack
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kestrel.weights.fp8 import Fp8CheckpointError, Fp8Config
from kestrel.weights.fp8 import dequantized_tensors as fp8_dequantized
from kestrel.weights.mxfp4 import Mxfp4CheckpointError, Mxfp4Config
from kestrel.weights.mxfp4 import dequantized_tensors as mxfp4_dequantized
from kestrel.weights.packed_ints import PackedIntCheckpointError, PackedIntConfig
from kestrel.weights.packed_ints import dequantized_tensors as packed_dequantized

logger = logging.getLogger("kestrel")

INDEX_FILE = "model.safetensors.index.json"
# Any of these makes a directory's tokenizer loadable; with none, the engine takes token ids.
# quant_method -> how its config is read; the tensors are dequantized at load.
STORED_QUANTIZATIONS = {"fp8": Fp8Config, "awq": PackedIntConfig, "gptq": PackedIntConfig, "mxfp4": Mxfp4Config}
# How each stored method's tensors become float ones, read across shards.
DEQUANTIZED = {Fp8Config: fp8_dequantized, PackedIntConfig: packed_dequantized, Mxfp4Config: mxfp4_dequantized}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class MissingWeightsError(FileNotFoundError):
    pass


class CheckpointNotFoundError(FileNotFoundError):
    pass


class CorruptWeightsError(ValueError):
    pass


def _open_shard(path: Path) -> Any:
    """A safetensors file opened for reading; one that cannot be read is an error naming it."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as error:
        raise CorruptWeightsError(
            f"cannot read {path}: {error} (a truncated or corrupt file? download it again)"
        ) from None
    except OSError as error:  # unreadable: permissions, a dangling link
        raise CorruptWeightsError(f"cannot read {path}: {error}") from None


class UnsupportedQuantizationError(ValueError):
    pass


class Checkpoint(ABC):
    """One model's files: read-only, opened once, shared by every rank's loading."""

    path: Path  # what messages name
    format: str  # "safetensors" | "gguf": the load_format that names it

    @abstractmethod
    def hf_config(self) -> Any:
        """The transformers config (architecture, sizes, rope, eos)."""

    @abstractmethod
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight tensor under its Hugging Face name, each exactly once."""

    @abstractmethod
    def tokenizer(self) -> Any | None:
        """The checkpoint's tokenizer, or None where it ships none (token ids in and out)."""

    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids generation stops at, beyond the config's and the tokenizer's own."""

    def stored_quantization(self) -> str | None:
        """The weight-only quantization that keeps what the file stores ("int4" for 4-bit
        groups), or None where its weights are floats."""
        return None


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face directory: config.json, *.safetensors (sharded or not), tokenizer files."""

    format = "safetensors"

    def __init__(self, path: Path) -> None:
        if not (path / "config.json").exists():
            raise CheckpointNotFoundError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
        self.path = path

    @cached_property
    def _config(self) -> Any:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.path)
        except (ValueError, KeyError) as error:
            self._refuse_unsupported_architecture()
            raise ValueError(f"cannot read {self.path / 'config.json'}: {error}") from None
        self._stored = None
        quantization = getattr(config, "quantization_config", None)
        if quantization:
            if not isinstance(quantization, dict):
                quantization = quantization.to_dict()
            method = str(quantization.get("quant_method", "unknown")).lower()
            if method not in STORED_QUANTIZATIONS:
                raise UnsupportedQuantizationError(
                    f"{self.path}: quantization method {method!r} is not supported yet (supported: "
                    f"{', '.join(repr(m) for m in STORED_QUANTIZATIONS)}); load one of those or an unquantized "
                    "(bf16/fp16/fp32) checkpoint"
                )
            try:
                self._stored = STORED_QUANTIZATIONS[method].from_quantization_config(quantization)
            except (Fp8CheckpointError, PackedIntCheckpointError, Mxfp4CheckpointError) as error:
                raise UnsupportedQuantizationError(f"{self.path}: {error}") from None
            logger.info("%s stores %s weights: dequantized at load", self.path, method.upper())
        return config

    def _refuse_unsupported_architecture(self) -> None:
        """Where transformers cannot read the config: an architecture Kestrel has no recipe for
        is named as such (with the ones it has), before transformers' own complaint."""
        from kestrel.models.registry import recipe_for

        try:
            declared = json.loads((self.path / "config.json").read_text()).get("architectures")
        except (ValueError, AttributeError):
            return  # not a JSON object: transformers' error says what is wrong
        if declared:
            recipe_for(declared)  # raises UnsupportedArchitectureError, listing the supported ones

    def hf_config(self) -> Any:
        return self._config

    def files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [self.path / name for name in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.exists()]
            if absent:
                raise MissingWeightsError(f"{INDEX_FILE} in {self.path} names missing files: {', '.join(absent)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise MissingWeightsError(
                f"no *.safetensors weights in {self.path}; Kestrel loads safetensors or GGUF checkpoints "
                "(or use load_format='dummy' for random weights)"
            )
        return files

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        stored = self._stored if self._config is not None else None  # reading the config finds it
        if stored is None:
            for path in self.files():
                with _open_shard(path) as shard:
                    names = list(shard.keys())  # a safetensors handle is not a mapping
                    for name in names:
                        yield name, shard.get_tensor(name)
            return
        # A layer's pieces (weight and scales, or codes, zeros and scales) may sit in different
        # shards: every shard stays open and each tensor is read from wherever it is.
        with ExitStack() as stack:
            shards = [stack.enter_context(_open_shard(path)) for path in self.files()]
            where = {name: shard for shard in shards for name in list(shard.keys())}
            transform = DEQUANTIZED[type(stored)]
            yield from transform(list(where), lambda name: where[name].get_tensor(name), stored)

    def tokenizer(self) -> Any | None:
        if not any((self.path / name).exists() for name in TOKENIZER_FILES):
            logger.warning("%s has no tokenizer files: prompts must be token ids", self.path)
            return None
        return load_tokenizer_from(str(self.path))

    def eos_token_ids(self) -> frozenset[int]:
        if not (self.path / "generation_config.json").exists():
            return frozenset()
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


class GgufCheckpoint(Checkpoint):
    """One GGUF file: config, tokenizer and chat template from its metadata; weights dequantized."""

    format = "gguf"

    def __init__(self, path: Path) -> None:
        from kestrel.weights.gguf_file import GgufFile

        self.path = path
        self.file = GgufFile(path)

    def hf_config(self) -> Any:
        from kestrel.weights.gguf_checkpoint import hf_config

        return hf_config(self.file)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from kestrel.weights.gguf_checkpoint import hf_tensors

        return hf_tensors(self.file)

    def tokenizer(self) -> Any | None:
        from kestrel.weights.gguf_tokenizer import gguf_tokenizer

        if "tokenizer.ggml.tokens" not in self.file.metadata:
            logger.warning("%s carries no tokenizer: prompts must be token ids", self.path)
            return None
        return gguf_tokenizer(self.file)

    def eos_token_ids(self) -> frozenset[int]:
        from kestrel.weights.gguf_tokenizer import end_of_turn_ids

        return end_of_turn_ids(self.file)

    def stored_quantization(self) -> str | None:
        from kestrel.weights.gguf_checkpoint import stored_quantization

        return stored_quantization(self.file)


def load_tokenizer_from(source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, ImportError) as error:
        raise ValueError(f"cannot load a tokenizer from {source}: {error}") from None


def _gguf_in(directory: Path) -> Path | None:
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise CheckpointNotFoundError(f"{directory} holds several GGUF files ({names}); pass the one to load")
    return files[0] if files else None


def open_checkpoint(model: str, revision: str | None = None) -> Checkpoint:
    """A directory, a `.gguf` file, a directory holding one GGUF file, or a Hugging Face id
    (`org/name`) in the local Hugging Face cache (downloaded first where a network exists)."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointNotFoundError(f"{path} is a file but not a .gguf file; pass a checkpoint directory")
        return GgufCheckpoint(path)
    if path.is_dir():
        if (path / "config.json").exists():
            return SafetensorsCheckpoint(path)
        gguf = _gguf_in(path)
        if gguf is not None:
            return GgufCheckpoint(gguf)
        raise CheckpointNotFoundError(
            f"{path} has no config.json and no .gguf file; pass a Hugging Face checkpoint directory or a GGUF file"
        )
    if _looks_like_hub_id(model):
        return open_checkpoint(str(hub_snapshot(model, revision)))
    raise CheckpointNotFoundError(
        f"model {model!r} is not a directory, a .gguf file or a Hugging Face model id ('org/name')"
    )


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def hub_snapshot(model_id: str, revision: str | None) -> Path:
    """The local snapshot of a Hugging Face model: from the cache, or downloaded when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
    try:
        return Path(snapshot_download(model_id, revision=revision, local_files_only=True, allow_patterns=patterns))
    except HFValidationError as error:
        raise CheckpointNotFoundError(f"{model_id!r} is not a valid Hugging Face model id: {error}") from None
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns))
    except Exception as error:  # offline, unknown id, gated repository: all say the same to a user
        raise CheckpointNotFoundError(
            f"model {model_id!r} is not in the local Hugging Face cache and could not be downloaded: {error}"
        ) from None
