"""WeightBindings: checkpoint tensor name -> parameter slot, with strict accounting.

A module whose parameters are stacked from several checkpoint tensors (q, k, v -> qkv)
implements `ShardedModule`: it names the pieces and loads each into its slice. Every piece
of every parameter must be bound exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

logger = logging.getLogger("kestrel")


class WeightBindingError(ValueError):
    pass


@dataclass(frozen=True)
class PackedMapping:
    """Checkpoint module suffix `source` is shard `shard_id` of the module `target`."""

    source: str  # e.g. "q_proj"
    target: str  # e.g. "qkv_proj"
    shard_id: str | None  # e.g. "q"; None for a plain rename


@runtime_checkable
class ShardedModule(Protocol):
    """A module whose parameters are stacked from named pieces."""

    def shard_ids(self) -> frozenset[str]: ...

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str) -> None: ...


def copy_whole(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightBindingError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


@dataclass(frozen=True)
class SkippedPrefix:
    """Checkpoint tensors under `prefix` that this model does not use, and why (said once in
    the log): a vision tower beside a text model, multi-token-prediction heads."""

    prefix: str  # e.g. "mtp."
    reason: str  # e.g. "multi-token prediction heads (speculative decoding does not use them yet)"


class WeightBindings:
    def __init__(
        self,
        model: nn.Module,
        packed: Iterable[PackedMapping] = (),
        ignored_names: Iterable[str] = (),
        skipped: Iterable[SkippedPrefix] = (),
        renamed_prefixes: Mapping[str, str] | None = None,
    ) -> None:
        self._params = dict(model.named_parameters())
        self._owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in self._params}
        self._packed = tuple(packed)
        self._ignored = frozenset(ignored_names)
        self._skipped = tuple(skipped)
        self._skipped_counts = dict.fromkeys(self._skipped, 0)
        # A checkpoint prefix -> the model's (a multimodal checkpoint's "model.language_model."
        # -> "model."), applied before anything else.
        self._renamed = dict(renamed_prefixes or {})
        self._loaded: dict[str, set[str | None]] = {name: set() for name in self._params}
        self._unexpected: list[str] = []

    def skip_instead(self, bound_prefix: str, skipped: Iterable[SkippedPrefix]) -> None:
        """Bind the tensors under `bound_prefix` after all, and skip `skipped` instead (an MTP
        draft binds the `mtp.` tensors its target skips, and skips the target's layers)."""
        self._skipped = tuple(s for s in self._skipped if s.prefix != bound_prefix) + tuple(skipped)
        self._skipped_counts = dict.fromkeys(self._skipped, 0)

    def _resolve(self, name: str) -> tuple[str, str | None]:
        for mapping in self._packed:
            piece = f".{mapping.source}."
            if piece in name:
                return name.replace(piece, f".{mapping.target}."), mapping.shard_id
        return name, None

    def _skip(self, name: str) -> bool:
        for skipped in self._skipped:
            if name.startswith(skipped.prefix):
                self._skipped_counts[skipped] += 1
                return True
        return name in self._ignored or name.endswith("rotary_emb.inv_freq")

    def _rename(self, name: str) -> str:
        for old, new in self._renamed.items():
            if name.startswith(old):
                return new + name.removeprefix(old)
        return name

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        if self._skip(name):
            return
        name = self._rename(name)
        param_name, shard_id = self._resolve(name)
        param = self._params.get(param_name)
        if param is None:
            self._unexpected.append(name)
            return
        if shard_id in self._loaded[param_name]:
            raise WeightBindingError(f"checkpoint tensor {name} is bound twice")
        owner = self._owners[param_name]
        try:
            with torch.no_grad():
                if isinstance(owner, ShardedModule):
                    owner.load_shard(param, tensor, shard_id)
                else:
                    copy_whole(param, tensor)
        except WeightBindingError as error:
            raise WeightBindingError(f"cannot bind {name}: {error}") from None
        self._loaded[param_name].add(shard_id)

    def missing(self) -> list[str]:
        """Parameters no checkpoint tensor filled, named as the checkpoint would name them
        (renamed prefixes undone)."""
        result = []
        for name in self._params:
            owner = self._owners[name]
            required = owner.shard_ids() if isinstance(owner, ShardedModule) else frozenset({None})
            absent = set(required) - self._loaded[name]
            stored = self._stored_name(name)
            result.extend(stored if shard is None else f"{stored}[{shard}]" for shard in sorted(absent, key=str))
        return result

    def _stored_name(self, name: str) -> str:
        for old, new in self._renamed.items():
            if name.startswith(new):
                return old + name.removeprefix(new)
        return name

    def finish(self) -> None:
        """Raise if any parameter was left unbound or any checkpoint tensor had no slot."""
        missing = self.missing()
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing)}")
        if self._unexpected:
            problems.append(f"unexpected in the checkpoint: {', '.join(self._unexpected)}")
        if problems:
            raise WeightBindingError("checkpoint does not match the model; " + "; ".join(problems))
        for skipped, count in self._skipped_counts.items():
            if count:
                logger.info("skipped %d checkpoint tensors under %s: %s", count, skipped.prefix, skipped.reason)
