"""Gated delta rule (the linear attention of Qwen3-Next and Qwen3.5) and its causal
convolution, in torch: a chunked form for prefill, the recurrent form for decode.

Per head, with a state S [key_dim, value_dim], each token t does
    S <- exp(g_t) * S                          (decay; g_t <= 0)
    u_t = beta_t * (v_t - S^T k_t)             (the delta: what S does not yet predict)
    S <- S + k_t u_t^T
    o_t = S^T q_t

The chunked form computes a chunk of C tokens with matmuls. With gamma_t the cumulative
log decay inside the chunk and S_0 the state entering it, the deltas solve the unit lower
triangular system (I + A) U = beta*V - diag(beta * exp(gamma)) K S_0, where
A[t, s] = beta_t exp(gamma_t - gamma_s) k_t.k_s for s < t; then
    O = diag(exp(gamma)) Q S_0 + (M * Q K^T) U,       M[t, s] = exp(gamma_t - gamma_s), s <= t
    S_C = exp(gamma_C) S_0 + (diag(exp(gamma_C - gamma)) K)^T U.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_gated_delta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: query, key [tokens, heads, key_dim], value [tokens, heads, value_dim],
    log_decay, beta [tokens, heads], state [heads, key_dim, value_dim] (float32).
    Returns the output [tokens, heads, value_dim] and the state after the last token."""
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [heads, tokens, dim]
    g, b = log_decay.transpose(0, 1), beta.transpose(0, 1)  # [heads, tokens]
    outputs = []
    for start in range(0, q.shape[1], chunk):
        rows = slice(start, start + chunk)
        output, state = _chunk(q[:, rows], k[:, rows], v[:, rows], g[:, rows], b[:, rows], state)
        outputs.append(output)
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def _chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    size = q.shape[1]
    gamma = g.cumsum(dim=-1)  # [heads, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # exp only where s <= t: elsewhere gamma_t - gamma_s is positive and could overflow.
    pair_decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    system = b[:, :, None] * (k @ k.transpose(-1, -2)) * pair_decay  # strictly lower part used
    rhs = torch.cat((b[..., None] * v, (b * gamma.exp())[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    value_part, key_part = solved.split((v.shape[-1], k.shape[-1]), dim=-1)
    deltas = value_part - key_part @ state  # [heads, C, value_dim]
    output = (q * gamma.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * pair_decay) @ deltas
    last = gamma[:, -1:]
    state = state * last.exp()[..., None] + (k * (last - gamma).exp()[..., None]).transpose(-1, -2) @ deltas
    return output, state


def recurrent_gated_delta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of sequences: query, key [seqs, heads, key_dim], value
    [seqs, heads, value_dim], log_decay, beta [seqs, heads], state [seqs, heads, key_dim,
    value_dim]. Returns the output [seqs, heads, value_dim] and the new states."""
    state = state * log_decay.exp()[..., None, None]
    predicted = torch.einsum("nhkv,nhk->nhv", state, key)
    delta = beta[..., None] * (value - predicted)
    state = state + key[..., None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, query), state


def causal_conv(x: torch.Tensor, prior: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the depthwise causal convolution, then SiLU. x [tokens, channels],
    prior [channels, width] (the inputs before x, zeros at a sequence's start), weight
    [channels, width + 1]. Returns the output [tokens, channels] and the new prior."""
    full = torch.cat((prior, x.transpose(0, 1).to(prior.dtype)), dim=-1)  # [channels, width + tokens]
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).transpose(0, 1).to(x.dtype), full[:, full.shape[1] - prior.shape[1] :]


def causal_conv_step(x: torch.Tensor, prior: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of sequences: x [seqs, channels], prior [seqs,
    channels, width]. Returns the output [seqs, channels] and the new priors."""
    full = torch.cat((prior, x[..., None].to(prior.dtype)), dim=-1)  # [seqs, channels, width + 1]
    out = (full * weight[None]).sum(dim=-1)
    return F.silu(out).to(x.dtype), full[..., 1:]
