"""OpenAI response bodies: completions (with the legacy logprobs format) and chat completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kestrel.engine.detokenizer import IncrementalDetokenizer
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
    offsets: Sequence[int],
) -> dict[str, list]:
    """The completions API's {tokens, token_logprobs, top_logprobs, text_offset}; `offsets` are
    where each token's text starts in the choice's text."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for token_id, entry in zip(token_ids, entries):
        result["tokens"].append(piece(token_id))
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(entry[token_id].logprob)
        result["top_logprobs"].append(dict(_top(entry, count, piece)))
    return result


def prompt_logprobs_entries(
    token_ids: list[int], entries: list[PositionLogprobs | None], count: int, piece: Any
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: for each prompt token, None where nothing precedes it, else
    {token id: {logprob, rank, decoded_token}} for the prompt's own token and the `count`
    most likely ones at that position."""
    rendered: list[dict[str, dict] | None] = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            rendered.append(None)
            continue
        likeliest = sorted(entry.items(), key=lambda item: -item[1].logprob)[:count]
        chosen = {token_id: entry[token_id], **dict(likeliest)}
        rendered.append(
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": piece(t)} for t, lp in chosen.items()}
        )
    return rendered


def text_offsets(tokenizer: Any, context_ids: list[int], token_ids: list[int], start: int) -> list[int]:
    """Where each token's text starts, decoding as the engine does (after `context_ids`), so the
    offsets add up to the text even where a token ends inside a UTF-8 character."""
    detokenizer = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens=True)
    offsets = []
    for token_id in token_ids:
        offsets.append(start + len(detokenizer.text))
        detokenizer.push(token_id)
    return offsets


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), stand-in -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in stand_ins)
    stand_ins.update({byte: chr(256 + index) for index, byte in enumerate(others)})
    return {char: byte for byte, char in stand_ins.items()}


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """A token's own bytes: for byte-level vocabularies the exact bytes, even where the token
    ends inside a UTF-8 character (its text alone would be a replacement character)."""
    raw = tokenizer.convert_ids_to_tokens(token_id)
    if raw and all(char in BYTE_LEVEL for char in raw):
        return [BYTE_LEVEL[char] for char in raw]
    return list(tokenizer.decode([token_id]).encode("utf-8"))


def chat_logprobs(
    token_ids: list[int], entries: list[PositionLogprobs], count: int, piece: Any, tokenizer: Any
) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": piece(token_id), "logprob": logprob, "bytes": token_bytes(tokenizer, token_id)}

    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda pair: -pair[1].logprob)[:count]
        top = [item(token, logprob.logprob) for token, logprob in ranked]
        content.append(item(token_id, entry[token_id].logprob) | {"top_logprobs": top})
    return {"content": content}
