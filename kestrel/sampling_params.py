"""SamplingParams: how to pick each next token and when to stop, shaped like vLLM's."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Below this, a temperature means greedy decoding (vLLM's convention).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """Which outputs a request reports while it runs (vLLM's names)."""

    CUMULATIVE = "cumulative"  # after every new token, everything so far
    DELTA = "delta"  # after every new token, only what is new (streaming without per-step copies)
    FINAL_ONLY = "final_only"  # once, when it finishes: no per-step copies of a long output


_CONSTRAINTS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names); exactly one of the constraints is set.

    `json` is a JSON schema (a dict or its text), `regex` a regular expression, `choice` a
    list of strings (the output is one of them), `grammar` an EBNF grammar (GBNF / xgrammar
    syntax), `json_object` any JSON object. With `disable_any_whitespace`, JSON comes without
    free whitespace between tokens (small models otherwise tend to emit runs of it).
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        # As compact text, the cache key: properties keep their order (the grammar writes them
        # in that order), spacing does not count; invalid JSON text stays for the compiler to name.
        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", json.dumps(self.json))
        elif isinstance(self.json, str):
            with contextlib.suppress(ValueError):
                object.__setattr__(self, "json", json.dumps(json.loads(self.json)))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            named = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"structured outputs take one of json, regex, choice, grammar, json_object; got {named}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)

    def cache_key(self) -> tuple:
        return (self.kind, self.json, self.regex, self.choice, self.grammar, self.disable_any_whitespace)


# vLLM's earlier name for the same thing.
GuidedDecodingParams = StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the chosen tokens' logits before sampling ({token_id: bias}, bias in [-100, 100]).
    logit_bias: Mapping[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: tuple[int, ...] | None = None
    # Words never to generate (vLLM's rule: a word's last token is banned once the tokens
    # before it were generated); the engine tokenizes them into `bad_words_token_ids`.
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match a schema, regex, choice or grammar (a token mask per step).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:
            bias = {int(token): float(value) for token, value in dict(self.logit_bias).items()}
            object.__setattr__(self, "logit_bias", bias or None)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        # Counts the sampler indexes with: a float one failed inside the engine's step.
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, numbers.Integral):  # numpy's integers too
                raise ValueError(f"{name} must be an integer, got {value!r}")
        token_ids = (*self.stop_token_ids, *(self.allowed_token_ids or ()))
        if not all(isinstance(token, numbers.Integral) for token in token_ids):
            raise ValueError("stop_token_ids and allowed_token_ids must be integer token ids")
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            # Infinite, every logit divides to 0 or NaN: masked tokens came back sampled.
            (0 <= self.temperature < math.inf, f"temperature must be finite and non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (
                self.max_tokens is None or self.max_tokens >= 0,
                f"max_tokens must be non-negative, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (
                all(t >= 0 and -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()),
                "logit_bias maps non-negative token ids to biases in [-100, 100]",
            ),
            (
                self.allowed_token_ids is None or (self.allowed_token_ids and min(self.allowed_token_ids) >= 0),
                "allowed_token_ids must be a non-empty list of non-negative token ids",
            ),
            (all(w.strip() for w in self.bad_words), "bad_words must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.top_k != 0 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constrains_tokens(self) -> bool:
        """Logit bias, an allow-list or bad words: logits change before sampling."""
        return self.logit_bias is not None or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def needs_output_tokens(self) -> bool:
        """The sampler reads the tokens generated so far (penalties, multi-token bad words)."""
        return self.uses_penalties or bool(self.bad_words_token_ids)

    def token_ids_named(self) -> list[int]:
        """Every token id the params name, for a check against the vocabulary."""
        words = [token for word in self.bad_words_token_ids for token in word]
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or ()), *words]

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """A single stop string or any iterable of them, as an immutable tuple."""
    if isinstance(stop, str):
        return (stop,)
    strings = tuple(stop or ()) if stop is None or isinstance(stop, Iterable) else None
    if strings is None or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r:.80}")
    return strings
