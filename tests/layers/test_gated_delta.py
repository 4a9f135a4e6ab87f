"""The chunked gated delta rule and the convolution against their token-by-token forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.layers.gated_delta import (
    causal_conv,
    causal_conv_step,
    chunked_gated_delta,
    l2_normalize,
    recurrent_gated_delta,
)


def _inputs(tokens: int, heads: int = 3, key_dim: int = 8, value_dim: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(tokens, heads, key_dim, generator=generator)) * key_dim**-0.5
    k = l2_normalize(torch.randn(tokens, heads, key_dim, generator=generator))
    v = torch.randn(tokens, heads, value_dim, generator=generator)
    log_decay = -F.softplus(torch.randn(tokens, heads, generator=generator))
    beta = torch.rand(tokens, heads, generator=generator)
    state = torch.randn(heads, key_dim, value_dim, generator=generator)
    return q, k, v, log_decay, beta, state


def _token_by_token(q, k, v, log_decay, beta, state):
    outputs = []
    state = state[None]
    for t in range(q.shape[0]):
        out, state = recurrent_gated_delta(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], log_decay[t : t + 1], beta[t : t + 1], state
        )
        outputs.append(out)
    return torch.cat(outputs), state[0]


@pytest.mark.parametrize("tokens, chunk", [(1, 4), (7, 4), (8, 4), (50, 16), (130, 64)])
def test_chunked_matches_the_recurrence(tokens, chunk):
    inputs = _inputs(tokens)
    expected_out, expected_state = _token_by_token(*inputs)
    out, state = chunked_gated_delta(*inputs, chunk=chunk)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_split_across_calls_carries_the_state():
    q, k, v, log_decay, beta, state = _inputs(40)
    whole, whole_state = chunked_gated_delta(q, k, v, log_decay, beta, state, chunk=16)
    first, mid_state = chunked_gated_delta(q[:23], k[:23], v[:23], log_decay[:23], beta[:23], state, chunk=16)
    second, end_state = chunked_gated_delta(q[23:], k[23:], v[23:], log_decay[23:], beta[23:], mid_state, chunk=16)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end_state, whole_state, atol=1e-5, rtol=1e-5)


def test_convolution_by_chunks_and_by_steps_matches_zero_padded_conv():
    generator = torch.Generator().manual_seed(1)
    channels, kernel, tokens = 6, 4, 11
    x = torch.randn(tokens, channels, generator=generator)
    weight = torch.randn(channels, kernel, generator=generator)
    padded = F.conv1d(x.T[None], weight[:, None, :], padding=kernel - 1, groups=channels)[0, :, :tokens]
    expected = F.silu(padded).T
    prior = torch.zeros(channels, kernel - 1)
    head, prior = causal_conv(x[:5], prior, weight)
    steps = []
    for t in range(5, tokens):
        out, stepped = causal_conv_step(x[t : t + 1], prior[None], weight)
        prior = stepped[0]
        steps.append(out)
    torch.testing.assert_close(torch.cat([head, *steps]), expected, atol=1e-6, rtol=1e-6)
