"""`compilation_config` / `--compilation-config` (vLLM's names): whether decode steps are
compiled on the CPU runtime, and for which batch sizes.

Mode 0 runs every step eagerly (the default). Mode 3 (vLLM's default when it compiles)
compiles each decode step of a listed batch size whole with torch.compile, the CPU runtime's
counterpart of CUDA graphs (`core/runtime/cpu.py`); other steps stay eager. vLLM's modes 1 and
2 (torch.compile as it comes, one trace) have no separate meaning here and are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kestrel.engine import config_json

NONE, COMPILED = 0, 3
FIELDS = ("mode", "level", "compile_sizes")  # "level": vLLM's older name for "mode"
DEFAULT_COMPILE_SIZES = (1,)  # one compilation takes tens of seconds on a small CPU


@dataclass(frozen=True)
class CompilationConfig:
    mode: int = NONE
    compile_sizes: tuple[int, ...] = DEFAULT_COMPILE_SIZES  # decode batch sizes compiled

    def __post_init__(self) -> None:
        if self.mode not in (NONE, COMPILED):
            raise ValueError(
                f"compilation_config mode {self.mode} is not supported; supported: 0 (eager) and 3 "
                "(decode steps compiled whole on the CPU)"
            )
        sizes = self.compile_sizes
        if not sizes or any(not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"compilation_config compile_sizes must be positive integers, got {list(sizes)}")
        object.__setattr__(self, "compile_sizes", tuple(sorted(set(sizes))))

    @property
    def compiles(self) -> bool:
        return self.mode == COMPILED

    @classmethod
    def parse(cls, value: CompilationConfig | Mapping[str, Any] | str | int) -> CompilationConfig:
        """From a dict, its JSON text, or a bare mode (`-O3`); unknown fields are errors."""
        if isinstance(value, CompilationConfig):
            return value
        value = config_json.loads(value, "compilation_config")
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(mode=value)
        if not isinstance(value, Mapping):
            raise ValueError(f"compilation_config must be a JSON object or a mode, got {type(value).__name__}")
        config_json.check_fields(value, "compilation_config", FIELDS)
        if "mode" in value and "level" in value and value["mode"] != value["level"]:
            raise ValueError("compilation_config gives both mode and level (its older name) with different values")
        mode = value.get("mode", value.get("level", NONE))
        if "compile_sizes" in value and mode != COMPILED:
            raise ValueError("compilation_config compile_sizes are the batch sizes mode 3 compiles; give mode 3 too")
        sizes = value.get("compile_sizes", DEFAULT_COMPILE_SIZES)
        if not isinstance(mode, int) or isinstance(mode, bool) or not isinstance(sizes, (list, tuple)):
            raise ValueError("compilation_config mode must be an integer and compile_sizes a list of integers")
        return cls(mode=mode, compile_sizes=tuple(sizes))
