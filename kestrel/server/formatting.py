"""OpenAI response bodies: completions (with the legacy logprobs format) and chat completions."""

from __future__ import annotations

from typing import Any

from kestrel.engine.outputs import PositionLogprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top(entry: PositionLogprobs, count: int, piece: Any) -> list[tuple[str, float]]:
    ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[:count]
    return [(piece(token_id), lp.logprob) for token_id, lp in ranked]


def token_id_piece(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` rendering: unique where texts may collide or be partial."""
    return f"token_id:{token_id}"


def legacy_logprobs(
    token_ids: list[int],
    entries: list[PositionLogprobs | None],
    count: int,
    piece: Any,
    text_offset: int = 0,
) -> dict[str, list]:
    """The completions API's {tokens, token_logprobs, top_logprobs, text_offset}."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = piece(token_id)
        result["tokens"].append(text)
        result["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(entry[token_id].logprob)
        result["top_logprobs"].append(dict(_top(entry, count, piece)))
    return result


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], count: int, piece: Any) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = piece(token_id)
        content.append(
            {
                "token": text,
                "logprob": entry[token_id].logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in _top(entry, count, piece)
                ],
            }
        )
    return {"content": content}
