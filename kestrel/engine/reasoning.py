"""Reasoning output: where a thinking model's reasoning ends and its answer starts.

A reasoning parser (vLLM's `--reasoning-parser` names) knows the markers around the
reasoning. The server splits each output into `reasoning_content` and `content` with it, and
the engine starts a request's structured-output grammar after the end marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    start: str  # "<think>"
    end: str  # "</think>"
    # Whether an output without either marker is all reasoning: DeepSeek-R1's template ends
    # the prompt with the start marker, so its output begins inside the reasoning; a Qwen3
    # output without markers (thinking turned off) is all answer.
    starts_in_reasoning: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None where there was none."""
        if self.end not in text:
            if self.starts_in_reasoning or text.lstrip().startswith(self.start):
                return _strip_start(text, self.start), ""
            return None, text
        reasoning, content = text.split(self.end, 1)
        return _strip_start(reasoning, self.start), content

    def end_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        return tuple(tokenizer.encode(self.end, add_special_tokens=False))


def _strip_start(text: str, start: str) -> str:
    head = text.lstrip()
    return head[len(start) :] if head.startswith(start) else text


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
    "deepseek_r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
}


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


class ReasoningStream:
    """Splits an output arriving in pieces; text that might be the start of a marker waits
    for the next piece."""

    def __init__(self, reasoning: ReasoningFormat) -> None:
        self.format = reasoning
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def push(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) that `piece` completes."""
        self._text += piece
        visible = self._text if final else _hold_partial_marker(self._text, (self.format.start, self.format.end))
        reasoning, content = self.format.split(visible)
        if (
            reasoning is None
            and not final
            and not self.format.starts_in_reasoning
            and self.format.start.startswith(visible.lstrip())
        ):
            return "", ""  # the output may yet open with the start marker
        reasoning = reasoning or ""
        new = reasoning[self._sent_reasoning :], content[self._sent_content :]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return new


def _hold_partial_marker(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a trailing piece that could be the beginning of a marker."""
    for cut in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text
