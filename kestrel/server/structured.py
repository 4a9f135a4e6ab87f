"""What a request asks its output to match, from OpenAI's and vLLM's fields, and tool choices.

OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*` fields, and a
`tool_choice` of "required" or a named function each become one `StructuredOutputsParams`;
more than one at a time is a 400, as is a constraint the grammar engine cannot compile.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kestrel.engine.structured_outputs import GrammarError, grammar_of
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.server.protocol import bad_request

GRAMMAR_BACKENDS = ("auto", "xgrammar")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def from_response_format(value: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            message = "response_format json_schema needs a schema: {json_schema: {name, schema}}"
            raise bad_request(message, "response_format")
        return StructuredOutputsParams(json=spec["schema"])
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")


def from_vllm_fields(body: Any) -> list[tuple[str, StructuredOutputsParams]]:
    """(field, constraint) for each of vLLM's fields the request sets."""
    found = []
    if body.structured_outputs:
        unknown = sorted(set(body.structured_outputs) - set(_STRUCTURED_KEYS))
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields: {', '.join(unknown)}", "structured_outputs")
        found.append(("structured_outputs", _params("structured_outputs", **body.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if getattr(body, name) is not None:
            found.append((name, _params(name, **{key: getattr(body, name)})))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", _params("guided_grammar", grammar=body.guided_grammar)))
    return found


def _params(field: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as error:
        raise bad_request(str(error), field) from None


def requested_constraint(
    body: Any, tool_constraint: StructuredOutputsParams | None = None
) -> tuple[str, StructuredOutputsParams] | None:
    """(field, constraint) of the one constraint the request sets, or None; a 400 where it
    sets several."""
    backend = body.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available; use one of {', '.join(GRAMMAR_BACKENDS)}",
            "guided_decoding_backend",
        )
    found = from_vllm_fields(body)
    if body.response_format:
        response = from_response_format(body.response_format)
        if response is not None:
            found.append(("response_format", response))
    if tool_constraint is not None:
        found.append(("tool_choice", tool_constraint))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"a request takes one output constraint; this one sets {names}", found[1][0])
    return found[0] if found else None


async def checked_constraint(
    body: Any, tool_constraint: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The request's constraint, with a 400 naming what is wrong with its schema, regex or
    grammar (parsed off the event loop: a large schema takes a while)."""
    requested = requested_constraint(body, tool_constraint)
    if requested is None:
        return None
    field, constraint = requested
    try:
        await asyncio.to_thread(grammar_of, constraint)
    except GrammarError as error:
        raise bad_request(str(error), field) from None
    return constraint
