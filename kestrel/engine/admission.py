"""The admission rules every front end shares (the offline `LLM`, the engine and the HTTP
server): which prompts run, how the context window bounds the output, and how `n` fans out
into one engine request per sequence."""

from __future__ import annotations

from collections.abc import Sequence

from kestrel.sampling_params import SamplingParams


class AdmissionError(ValueError):
    """A request that cannot run; `param` names the field at fault (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt_tokens(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    if not token_ids:
        raise AdmissionError("the prompt is empty; it must contain at least one token", param)
    what = "prompt token ids" if param == "prompt" else param
    not_ints = [t for t in token_ids if not isinstance(t, int)]
    if not_ints:
        raise AdmissionError(f"{what} must be integers, got {not_ints[:5]}", param)
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise AdmissionError(f"{what} out of range [0, {vocab_size}): {bad[:5]}", param)


def resolve_max_tokens(
    prompt_len: int, requested: int | None, max_model_len: int, strict: bool, prompt_param: str = "prompt"
) -> int:
    """How many tokens the request may generate. The prompt must leave room for one token
    (unless none is asked for). `strict` (OpenAI's rule, the server's): a requested
    max_tokens past the window is an error; otherwise (vLLM's offline rule) it is clamped."""
    if requested is not None and requested < 0:
        raise AdmissionError(f"max_tokens must be non-negative, got {requested}", "max_tokens")
    if prompt_len > max_model_len or (prompt_len == max_model_len and requested != 0):
        raise AdmissionError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens, and at least one token must be generated. "
            "Please reduce the length of the input.",
            prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room and strict:
        raise AdmissionError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.",
            "max_tokens",
        )
    return min(requested, room)


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """One engine request's params per sequence of `n`: seeded ones get seed, seed + 1, ..."""
    return [params.replace(n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]
