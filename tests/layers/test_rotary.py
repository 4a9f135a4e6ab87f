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
