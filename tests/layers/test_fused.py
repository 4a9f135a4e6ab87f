"""Fused Triton kernels against the torch path (Triton's interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kestrel.layers import fused, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # one bf16 ulp apart at most
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 96, dtype=dtype, device=DEVICE)
    residual = torch.randn(5, 96, dtype=dtype, device=DEVICE)
    weight = torch.rand(96, dtype=dtype, device=DEVICE) + 0.5
    close(fused.rms_norm(x, weight, 1e-6), ops._torch_rms_norm(x.cpu(), weight.cpu(), 1e-6).to(DEVICE))
    normed, summed = fused.rms_norm(x, weight, 1e-6, residual)
    expected_sum = x.cpu() + residual.cpu()
    close(summed, expected_sum.to(DEVICE))
    close(normed, ops._torch_rms_norm(expected_sum, weight.cpu(), 1e-6).to(DEVICE))


def test_rms_norm_per_head_on_a_strided_view():
    torch.manual_seed(1)
    qkv = torch.randn(4, 3 * 4 * 32, device=DEVICE)
    query = qkv[:, : 4 * 32].view(4, 4, 32)  # rows of a wider tensor, as the q of a qkv projection
    weight = torch.rand(32, device=DEVICE) + 0.5
    close(fused.rms_norm(query, weight, 1e-6), ops._torch_rms_norm(query.cpu(), weight.cpu(), 1e-6).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(3, 2 * 1100, dtype=dtype, device=DEVICE)  # wider than one block
    gate, up = gate_up.cpu().float().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    close(fused.silu_and_mul(gate_up), expected.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [2, fused.ROTARY_HEADS + 4])  # one program; two, the second part-full
def test_rotary_in_place_on_a_strided_view(dtype, kv_heads):
    torch.manual_seed(3)
    qkv = torch.randn(6, (4 + 2 * kv_heads) * 64, dtype=dtype, device=DEVICE)
    key = qkv[:, 4 * 64 : (4 + kv_heads) * 64].view(6, kv_heads, 64)
    angles = torch.randn(6, 32)
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    expected = ops.rotary(key.cpu().clone(), cos, sin)
    query, value = qkv[:, : 4 * 64].clone(), qkv[:, (4 + kv_heads) * 64 :].clone()
    fused.rotary_(key, cos.to(DEVICE), sin.to(DEVICE))
    close(key, expected.to(DEVICE))
    # Neighbours in the same rows are left alone.
    assert torch.equal(qkv[:, : 4 * 64], query) and torch.equal(qkv[:, (4 + kv_heads) * 64 :], value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 2), (fused.ROTARY_HEADS, 4)])  # one program; two, part-full
def test_query_and_key_norms_and_rotary_in_one_pass(dtype, q_heads, kv_heads):
    torch.manual_seed(4)
    head_dim = 64
    qkv = torch.randn(5, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q_weight = (torch.rand(head_dim) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim) + 0.5).to(dtype)
    angles = torch.randn(5, head_dim // 2)
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)

    def heads(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        query = rows[:, : q_heads * head_dim].view(5, q_heads, head_dim)
        return query, rows[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(5, kv_heads, head_dim)

    reference = qkv.cpu().clone()
    expected_query, expected_key = ops.qk_norm_rotary(*heads(reference), q_weight, k_weight, 1e-6, cos, sin)
    value = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    device_weights = (q_weight.to(DEVICE), k_weight.to(DEVICE))
    query, key = heads(qkv)
    fused.qk_norm_rotary_(
        qkv[:, : (q_heads + kv_heads) * head_dim].view(5, q_heads + kv_heads, head_dim),
        q_heads,
        *device_weights,
        1e-6,
        cos.to(DEVICE),
        sin.to(DEVICE),
    )
    close(query, expected_query.to(DEVICE))
    close(key, expected_key.to(DEVICE))
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], value)  # the value heads are left alone


def cos_sin(tokens: int, rotary_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from kestrel.layers.rotary import RopeSpec, rotary_cos_sin

    positions = torch.arange(3, 3 + tokens, device=DEVICE)
    return rotary_cos_sin(positions, RopeSpec(theta=10000.0), rotary_dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [8, 32])
def test_head_norm_rotary_on_the_query_beside_its_gate(dtype, rotary_dim):
    """Qwen3-Next's query: each head's rows followed by its gate's (a strided view), a float32
    offset-folded weight, a partial rotary dim (8 of 32) or the whole head."""
    torch.manual_seed(7)
    tokens, heads, head_dim = 3, 5, 32
    query_gate = torch.randn(tokens, heads, 2 * head_dim, dtype=dtype, device=DEVICE)
    query = query_gate.chunk(2, dim=-1)[0]
    weight = torch.randn(head_dim, device=DEVICE) * 0.1 + 1
    cos, sin = cos_sin(tokens, rotary_dim, dtype)
    got = fused.head_norm_rotary(query, weight, 1e-6, cos, sin)
    expected = ops.head_norm_rotary(query.cpu(), weight.cpu(), 1e-6, cos.cpu(), sin.cpu())
    assert got.is_contiguous()
    close(got, expected.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_key_normalises_the_latent_and_rotates_the_rope_part(dtype):
    """DeepSeek's key: a projection's 40 latent columns normed, its 8 rope columns rotated,
    read from a wider row (a strided view), written as [tokens, 1, 48]."""
    torch.manual_seed(9)
    tokens, latent, rope = 4, 40, 8
    projection = torch.randn(tokens, latent + rope + 5, dtype=dtype, device=DEVICE)
    kv = projection[:, : latent + rope]
    weight = torch.rand(latent, dtype=dtype, device=DEVICE) + 0.5
    cos, sin = cos_sin(tokens, rope, dtype)
    got = fused.latent_key(kv, weight, 1e-6, cos, sin)
    expected = ops.latent_key(kv.cpu(), weight.cpu(), 1e-6, cos.cpu(), sin.cpu())
    assert got.shape == (tokens, 1, latent + rope) and got.is_contiguous()
    assert not torch.equal(expected[..., :latent], kv.cpu()[:, None, :latent])  # normed
    close(got, expected.to(DEVICE))


@pytest.mark.parametrize("heads", [3, 20])  # one program a token; two, the second part full
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_reads_its_gate_from_a_wider_projection(dtype, heads):
    torch.manual_seed(8)
    tokens, dim = 4, 16
    projection = torch.randn(tokens, 2 * heads * dim + 6, dtype=dtype, device=DEVICE)
    gate = projection[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    x = torch.randn(tokens, heads, dim, dtype=dtype, device=DEVICE)
    weight = (torch.rand(dim, device=DEVICE) + 0.5).to(dtype)
    got = fused.gated_rms_norm(x, gate, weight, 1e-6)
    close(got, ops.gated_rms_norm(x.cpu(), gate.cpu(), weight.cpu(), 1e-6).to(DEVICE))


@pytest.mark.parametrize("heads", [4, 20])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_with_each_heads_gate_beside_its_query(dtype, heads):
    torch.manual_seed(9)
    tokens, dim = 2, 16
    gate = torch.randn(tokens, heads, 2 * dim, dtype=dtype, device=DEVICE).chunk(2, dim=-1)[1]
    x = torch.randn(tokens, heads, dim, dtype=dtype, device=DEVICE)
    close(fused.sigmoid_gate(x, gate), ops.sigmoid_gate(x.cpu(), gate.cpu()).to(DEVICE))


@pytest.mark.parametrize("tokens", [1, 3])
def test_q_and_k_of_one_projection_take_the_fused_norm_and_rotary(tokens):
    """A batch-1 decode step's q and k views differ in their row stride (a one-row view takes
    its own width): they still sit side by side, so the one kernel applies."""
    qkv = torch.empty(tokens, (8 + 2 + 2) * 16)
    query, key, _ = qkv.split([8 * 16, 2 * 16, 2 * 16], dim=-1)
    assert ops._key_heads_follow(query.view(tokens, 8, 16), key.view(tokens, 2, 16))
    assert not ops._key_heads_follow(query.view(tokens, 8, 16), key.clone().view(tokens, 2, 16))


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_projections_match_the_batched_matmuls(dtype, tokens):
    """DeepSeek's absorbed query (each head's nope part times its key up-projection, the rope
    part rotated) and its values (each head's attended latent up through its value rows),
    at widths no program's block divides, read from views of one up-projection as the model
    reads them."""
    torch.manual_seed(tokens)
    heads, nope, rope, latent, value = 3, 24, 8, 72, 20
    up = torch.randn(heads, nope + value, latent, dtype=dtype, device=DEVICE) * 0.2
    key_up, value_up = up[:, :nope], up[:, nope:]
    projection = torch.randn(tokens, heads * (nope + rope), dtype=dtype, device=DEVICE)
    query = projection.view(tokens, heads, nope + rope)
    cos, sin = cos_sin(tokens, rope, dtype)
    got, no_key = fused.absorb_query(query, key_up, cos, sin)
    expected = ops.absorb_query(query.cpu().clone(), key_up.cpu(), cos.cpu(), sin.cpu())
    assert got.shape == (tokens, heads, latent + rope) and no_key is None
    close(got, expected.to(DEVICE))
    attended = torch.randn(tokens, heads, latent + rope, dtype=dtype, device=DEVICE)[..., :latent]
    got = fused.latent_values(attended, value_up)
    expected = ops.latent_values(attended.cpu(), value_up.cpu())
    assert got.shape == (tokens, heads * value) and got.is_contiguous()
    close(got, expected.to(DEVICE))


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_absorbing_launch_makes_the_latent_key_as_its_own_kernel_does(dtype, tokens):
    """The query and the latent read from one input projection's row (the model's layout):
    the one launch gives the absorbed query and, bit for bit, `fused.latent_key`'s key."""
    torch.manual_seed(10 + tokens)
    heads, nope, rope, latent = 3, 24, 8, 72
    key_up = torch.randn(heads, nope, latent, dtype=dtype, device=DEVICE) * 0.2
    projection = torch.randn(tokens, heads * (nope + rope) + latent + rope, dtype=dtype, device=DEVICE)
    query = projection[:, : heads * (nope + rope)].view(tokens, heads, nope + rope)
    kv = projection[:, heads * (nope + rope) :]
    norm_weight = torch.rand(latent, dtype=dtype, device=DEVICE) + 0.5
    cos, sin = cos_sin(tokens, rope, dtype)
    absorbed, key = fused.absorb_query(query, key_up, cos, sin, ops.LatentKey(kv, norm_weight, 1e-6))
    assert torch.equal(absorbed, fused.absorb_query(query, key_up, cos, sin)[0])
    assert torch.equal(key, fused.latent_key(kv, norm_weight, 1e-6, cos, sin))
    expected = ops.latent_key(kv.cpu(), norm_weight.cpu(), 1e-6, cos.cpu(), sin.cpu())
    close(key, expected.to(DEVICE))
