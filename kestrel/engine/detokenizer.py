"""Incremental detokenization and stop-string matching for one request's output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

# Prompt tokens decoded with the first output tokens so that tokenizers whose pieces
# depend on their left neighbour (leading spaces) produce the right text.
CONTEXT_TOKENS = 6


def fast_backend(tokenizer: Any) -> Tokenizer | None:
    """The Rust `tokenizers` object behind a fast HF tokenizer, when decoding through it
    gives the same text (no clean-up of spaces). The Python wrapper around it costs more
    than the decoding itself, and every running request decodes each step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return None


def fast_decode(tokenizer: Any) -> Callable[..., str]:
    backend = fast_backend(tokenizer)
    return tokenizer.decode if backend is None else backend.decode


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive, never emitting a broken UTF-8 character.

    With a fast tokenizer, `tokenizers`' DecodeStream does it in one Rust call per token;
    otherwise each token costs two decodes of a short window (the text before it, and with it).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.text = ""
        self._backend = fast_backend(tokenizer)
        self._stream = _decode_stream(context, skip_special_tokens) if self._backend is not None else None
        self._decode_ids = fast_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._stream is not None:
            new_text = self._stream.step(self._backend, token_id) or ""
        else:
            new_text = self._windowed(token_id)
        self.text += new_text
        return new_text

    def _windowed(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)


def _decode_stream(context: list[int], skip_special_tokens: bool) -> Any | None:
    """A DecodeStream primed with the prompt's last tokens, where this `tokenizers` has one."""
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


def find_stop_string(text: str, new_text_len: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The first stop string that the newest text completes, and where it starts."""
    best = None
    for stop in stops:
        search_from = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, search_from)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
