"""Structured outputs through the offline API on a tiny random model: whatever the model
prefers, every answer matches its schema, regex, choice or grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kestrel import SamplingParams
from kestrel.core.sampling import RowMasks, apply_token_bitmasks
from kestrel.engine.structured_outputs import GrammarError, StructuredOutputs, grammar_of
from kestrel.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "scores"],
    "additionalProperties": False,
}
SHAPE = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"radius": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["radius"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"side": {"type": "boolean"}},
            "required": ["side"],
            "additionalProperties": False,
        },
    ]
}


def sampled(seed: int, spec: StructuredOutputsParams, max_tokens: int = 96, **extra) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec, **extra)


@pytest.mark.parametrize("schema", [PERSON, SHAPE], ids=["object", "anyOf"])
def test_json_schema_answers_validate(qwen3_llm, schema):
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outputs = qwen3_llm.generate(["hello", "a b c", "x y"] * 2, [sampled(i, spec) for i in range(6)], use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_choice_regex_and_grammar_hold(qwen3_llm):
    choices = ["yes", "no", "not sure"]
    cases = [
        (StructuredOutputsParams(choice=choices), lambda text: text in choices),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-f]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-f]{2,4}", t)),
        (
            StructuredOutputsParams(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'),
            lambda text: re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", text),
        ),
        (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]
    for spec, holds in cases:
        params = [sampled(seed, spec, max_tokens=48) for seed in range(4)]
        for output in qwen3_llm.generate(["one", "two", "three", "four"], params, use_tqdm=False):
            text = output.outputs[0].text
            if spec.kind != "json_object" or output.outputs[0].finish_reason == "stop":
                assert holds(text), (spec.kind, text)


def test_constrained_and_free_requests_share_a_batch(qwen3_llm):
    """A free request's tokens do not change when constrained ones run beside it, in either
    scheduling mode, and the constrained ones still hold."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = qwen3_llm.generate(["the free one"], free, use_tqdm=False)[0].outputs[0].token_ids
    spec = StructuredOutputsParams(regex=r"[a-z ]{4,20}\.")
    prompts = ["the free one", "first", "second"]
    outputs = qwen3_llm.generate(prompts, [free, sampled(1, spec), sampled(2, spec)], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    for output in outputs[1:]:
        assert re.fullmatch(r"[a-z ]{4,20}\.", output.outputs[0].text)
    assert qwen3_llm.engine.structured.num_mask_steps > 0


def test_constrained_answers_match_across_scheduling_modes(checkpoint_dir):
    """Overlapped steps launch before the last step's samples are read, and only then fill
    the masks: the answers are those of steps run one after another, also where a grammar
    completes while the next step is already launched (its extra sample is dropped)."""
    from kestrel import LLM

    json_spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    specs = [
        json_spec,
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        StructuredOutputsParams(regex="[a-c]{2,9}"),
    ]
    params = (
        [SamplingParams(temperature=0, max_tokens=80, structured_outputs=json_spec)]
        + [sampled(seed, specs[seed % 3], max_tokens=60) for seed in range(7)]
        + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    )
    prompts = ["p", "q r", "s", "t u v", "w", "x", "y z", "a", "b c"]
    texts, overlapped = [], []
    for overlap in (True, False):
        llm = LLM(str(checkpoint_dir("qwen3")), async_scheduling=overlap, page_size=8)
        launch = llm.engine.parts.executor.launch

        def launch_noting_overlap(work, masks=None, engine=llm.engine, launch=launch):
            # A constrained decode whose last token is still on the device: it was planned
            # before the last step's samples were read.
            overlapped.append(any(w.follows_last_sample and w.params.structured_outputs for w in work))
            return launch(work, masks)

        llm.engine.parts.executor.launch = launch_noting_overlap
        texts.append([o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)])
    assert texts[0] == texts[1]
    assert any(overlapped), "constrained steps were meant to overlap with async scheduling"
    for text in texts[0][:1]:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutputsParams(json='{"type": "objectx"}'), 'Unsupported type "objectx"'),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="a(b"), "parenthesis is not closed"),
        (StructuredOutputsParams(grammar="root ::= "), "EBNF parser error"),
    ],
)
def test_an_invalid_constraint_is_refused_by_name(qwen3_llm, spec, says):
    with pytest.raises(GrammarError, match=re.escape(says)):
        grammar_of(spec)
    with pytest.raises(ValueError, match=re.escape(says)):
        qwen3_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert not qwen3_llm.engine.has_unfinished_requests()


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    same = StructuredOutputsParams(json={"b": 1, "a": 2}), StructuredOutputsParams(json='{"b":1,  "a": 2}')
    assert same[0].cache_key() == same[1].cache_key()  # one compiled grammar per schema
    # Property order is the order the grammar writes them in: another order, another grammar.
    assert same[0].cache_key() != StructuredOutputsParams(json={"a": 2, "b": 1}).cache_key()


def test_bitmasks_leave_only_allowed_tokens():
    logits = torch.zeros(3, 70)
    bitmasks = torch.zeros(2, 3, dtype=torch.int32)
    bitmasks[0, 0] = 0b101  # tokens 0 and 2
    bitmasks[1, 2] = 1 << 5  # token 69
    apply_token_bitmasks(logits, RowMasks((0, 2), bitmasks))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()  # an unconstrained row
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [69]


def test_the_grammar_starts_after_the_reasoning(qwen3_llm):
    """With a reasoning end marker, a request is free until the marker is generated, then
    masked; a prompt that already closed the reasoning is masked from the first token."""
    end = (7, 8)
    structured = StructuredOutputs(qwen3_llm.engine.structured.grammars, reasoning_end=end)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    structured.add("thinking", spec, [1, 2, 3])
    structured.add("closed", spec, [1, 2, 7, 8, 3])
    while not (structured.is_ready("thinking") and structured.is_ready("closed")):
        structured.wait_for_grammars(1.0)
    assert not structured.constrained("thinking") and structured.constrained("closed")
    for token in (5, 7, 6, 7, 8):
        assert structured.accept("thinking", token)
    assert structured.constrained("thinking")
    allowed = structured.fill(["thinking"])
    assert allowed.shape == (1, (qwen3_llm.engine.parts.spec.vocab_size + 31) // 32)
    assert 0 < int(torch.tensor([bin(w & 0xFFFFFFFF).count("1") for w in allowed[0].tolist()]).sum()) < 32
