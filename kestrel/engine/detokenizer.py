"""Incremental detokenization and stop-string matching for one request's output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

# Prompt tokens decoded with the first output tokens so that tokenizers whose pieces
# depend on their left neighbour (leading spaces) produce the right text.
CONTEXT_TOKENS = 6


def fast_decode(tokenizer: Any) -> Callable[..., str]:
    """The Rust `tokenizers` decoder behind a fast HF tokenizer when it gives the same text
    (no clean-up of spaces): the Python wrapper around it costs more than the decoding, and
    every running request decodes twice per step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive, never emitting a broken UTF-8 character."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._decode_ids = fast_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        new_text = after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new_text
        return new_text


def find_stop_string(text: str, new_text_len: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The first stop string that the newest text completes, and where it starts."""
    best = None
    for stop in stops:
        search_from = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, search_from)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
