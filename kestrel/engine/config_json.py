"""Engine options given as JSON objects (vLLM's `--speculative-config`, `--compilation-config`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def loads(value: Any, name: str) -> Any:
    """`value` itself, or what its JSON text holds when it is a string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not valid JSON: {error}") from None


def check_fields(value: Mapping[str, Any], name: str, known: Iterable[str]) -> None:
    """Refuse fields of option `name` that are not `known`, naming both."""
    known = tuple(known)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"unknown {name} fields: {', '.join(unknown)}; known: {', '.join(known)}")
