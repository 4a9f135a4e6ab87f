"""Rotary position embedding (rotate-half layout), with linear, llama3, YaRN and longrope
frequency scaling.

YaRN (Qwen3's and GPT-OSS's long-context setting) keeps the fast-turning frequencies,
divides the slow ones by `factor`, blends those between (a linear ramp over the dimensions
whose wavelengths fall between beta_fast and beta_slow turns of the pretraining length), and
scales cos and sin by an attention factor (0.1 ln(factor) + 1 unless given), as transformers
computes it.

LongRoPE (Phi-3, Phi-4) divides each frequency by a per-dimension factor, the "short" ones
for positions inside the pretraining length and the "long" ones past it, and scales cos and
sin by an attention factor. Here each position takes the factors of its own side of that
length, so a cached key never depends on how long its sequence grew later (what a prefix
cache needs). Hugging Face instead rotates a whole forward pass with the long factors once
any of its positions is past the length: decoding past it gives the same rotations, but a
single prompt longer than it is rotated with the long factors from its first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: str = "default"  # "default" | "linear" | "llama3" | "yarn" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per frequency, inside original_max_position
    long_factor: tuple[float, ...] = ()  # longrope: per frequency, past it
    attention_factor: float = 1.0  # longrope, yarn: cos and sin are scaled by it
    beta_fast: float = 32.0  # yarn: frequencies turning more often than this over the length are kept
    beta_slow: float = 1.0  # yarn: ... less often than this are divided by `factor`
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions


@lru_cache(maxsize=16)
def inverse_frequencies(rope: RopeSpec, rotary_dim: int, device: torch.device, long: bool = False) -> torch.Tensor:
    """The rotary frequencies; for longrope, divided by the short factors (or the long ones)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if rope.scaling == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return (1.0 / (factors * rope.theta**exponents)).to(device)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling == "yarn":
        return _yarn_blended(inv_freq, rope, rotary_dim).to(device)
    if rope.scaling == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq.to(device)


def _yarn_blended(inv_freq: torch.Tensor, rope: RopeSpec, rotary_dim: int) -> torch.Tensor:
    """Each frequency between kept (fast) and divided by `factor` (slow), by a linear ramp
    over the dimensions whose turns over the pretraining length lie between the two betas."""

    def dimension_of(turns: float) -> float:  # the dimension whose frequency makes `turns` turns
        return rotary_dim * math.log(rope.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of zero width
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1 where the frequency is fast enough to keep
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    low_freq_wavelen = rope.original_max_position / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def rotary_cos_sin(
    positions: torch.Tensor, rope: RopeSpec, rotary_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, rotary_dim] for the given positions, computed once per step."""
    inv_freq = inverse_frequencies(rope, rotary_dim, positions.device)
    if rope.scaling == "longrope":
        long = inverse_frequencies(rope, rotary_dim, positions.device, long=True)
        past = (positions >= rope.original_max_position)[:, None]
        inv_freq = torch.where(past, long[None, :], inv_freq[None, :])
    freqs = positions.float()[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    if rope.attention_factor != 1.0:
        return (angles.cos() * rope.attention_factor).to(dtype), (angles.sin() * rope.attention_factor).to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)
