"""Rotary frequencies against transformers' own, LongRoPE's two sides of the pretraining length."""

from __future__ import annotations

import math

import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kestrel.layers.rotary import rotary_cos_sin
from kestrel.models.dense import read_rope

ORIGINAL = 64
SHORT, LONG = [1.0, 1.5, 2.0, 4.0], [1.0, 4.0, 8.0, 16.0]


def phi3_config() -> Phi3Config:
    return Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        vocab_size=128,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": ORIGINAL,
            "partial_rotary_factor": 0.5,
        },
    )


def hf_cos_sin(config: Phi3Config, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * scaling, angles.sin() * scaling


def test_longrope_takes_the_short_factors_inside_the_pretraining_length_and_the_long_ones_past_it():
    config = phi3_config()
    rope = read_rope(config, allow_partial=True)
    assert rope.attention_factor == math.sqrt(1 + math.log(4) / math.log(ORIGINAL))  # factor 256 / 64
    inside, past = torch.arange(0, ORIGINAL), torch.arange(ORIGINAL, 3 * ORIGINAL)
    positions = torch.cat((inside, past))
    cos, sin = rotary_cos_sin(positions, rope, 8, torch.float32)
    short_cos, short_sin = hf_cos_sin(config, inside, seq_len=ORIGINAL)
    long_cos, long_sin = hf_cos_sin(config, past, seq_len=3 * ORIGINAL)
    torch.testing.assert_close(cos[:ORIGINAL], short_cos)
    torch.testing.assert_close(sin[:ORIGINAL], short_sin)
    torch.testing.assert_close(cos[ORIGINAL:], long_cos)  # what HF gives a step decoding out there
    torch.testing.assert_close(sin[ORIGINAL:], long_sin)


def test_yarn_matches_transformers_frequencies_and_attention_factor():
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    rope = read_rope(config)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert rope.attention_factor == scaling == 0.1 * math.log(4.0) + 1.0
    positions = torch.arange(0, 1024, 7)
    cos, sin = rotary_cos_sin(positions, rope, 32, torch.float32)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(cos, angles.cos() * scaling)
    torch.testing.assert_close(sin, angles.sin() * scaling)


def test_a_yarn_model_decodes_as_transformers_does(tmp_path):
    """A tiny Qwen3 with YaRN (factor 4 over a pretraining length of 16, so the prompts run
    past it): greedy tokens and logprobs as transformers gives them."""
    from transformers import AutoModelForCausalLM

    from kestrel import LLM, SamplingParams
    from tests.checkpoints import _family_configs, tokenizer

    config = _family_configs(len(tokenizer()), tokenizer().eos_token_id)["qwen3"]
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    prompt = [int(t) for t in torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(1))]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    expected = out.sequences[0, len(prompt) :].tolist()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gb=0.05)
    got = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
        use_tqdm=False,
    )[0].outputs[0]
    assert got.token_ids == expected
    for position, (token, score) in enumerate(zip(expected, out.scores)):
        assert abs(got.logprobs[position][token].logprob - float(score[0].log_softmax(-1)[token])) < 1e-4
