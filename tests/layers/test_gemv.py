"""The one-row Triton matvec against torch (the interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import triton

from kestrel.core.kernel_branches import kernels_on_cpu
from kestrel.layers import fused, gemv, ops
from kestrel.layers.linear import Linear
from kestrel.layers.quantized import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter runs float32 on the CPU; a GPU checks the half types the kernel serves.
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), [(48, 160, 16, 64), (37, 100, 8, 32), (64, 64, 32, 64)])
def test_gemv_matches_torch_on_ragged_shapes(dtype, n, k, block_n, block_k):
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    weight = torch.randn(n, k, device=DEVICE).to(dtype)
    expected = (x.float() @ weight.float().T).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    config = triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k})
    got = gemv.gemv(x, weight, config=config)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)
    with_bias = gemv.gemv(x, weight, bias, config=config)
    torch.testing.assert_close(with_bias.float(), (expected + bias).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "k", "block_n", "block_k"), [(40, 96, 16, 64), (37, 100, 8, 32)])
def test_gemv_silu_and_mul_is_the_linear_then_the_activation(dtype, width, k, block_n, block_k):
    torch.manual_seed(width + k)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    weight = torch.randn(2 * width, k, device=DEVICE).to(dtype)
    config = triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k})
    got = gemv.gemv_silu_and_mul(x, weight, config=config)
    assert got.shape == (1, width) and got.dtype == dtype
    # The same bits as the two kernels it replaces, run with the same launch...
    assert torch.equal(got, fused.silu_and_mul(gemv.gemv(x, weight, config=config)))
    # ...and torch's result, to rounding.
    gate, up = (x.float() @ weight.float().T).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, atol=5e-2, rtol=2e-2)


def test_gemv_silu_and_mul_needs_gate_and_up_rows():
    with pytest.raises(ValueError, match="gate and up rows stacked; got 5 rows"):
        gemv.gemv_silu_and_mul(torch.zeros(1, 8, device=DEVICE), torch.zeros(5, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("block_n", "block_k"), [(16, 64), (8, 32)])
def test_gemv_rotary_is_the_linear_then_the_rotary_of_its_query_and_key_heads(dtype, with_bias, block_n, block_k):
    torch.manual_seed(block_n)
    head_dim, rotated_heads, heads, k = 16, 3, 4, 72  # 2 query + 1 key head rotated; 1 value head
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    weight = torch.randn(heads * head_dim, k, device=DEVICE).to(dtype)
    bias = torch.randn(heads * head_dim, device=DEVICE).to(dtype) if with_bias else None
    angles = torch.rand(1, head_dim // 2, device=DEVICE).repeat(1, 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    config = triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k})
    rotation = ops.HeadRotation(cos, sin, rotated_heads, head_dim)
    got = gemv.gemv_rotary(x, weight, bias, rotation, config=config)
    assert got.shape == (1, heads * head_dim) and got.dtype == dtype
    # The same bits as the two kernels it replaces, run with the same launch...
    separate = gemv.gemv(x, weight, bias, config=config)
    rotated_width = rotated_heads * head_dim
    fused.rotary_(separate[:, :rotated_width].view(1, rotated_heads, head_dim), cos, sin)
    assert torch.equal(got, separate)
    # ...and torch's result, to rounding: rotated query and key heads, the value head as is.
    plain = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    heads_view = plain.view(heads, head_dim)
    first, second = heads_view.chunk(2, dim=-1)
    turned = heads_view * cos.float() + torch.cat((-second, first), dim=-1) * sin.float()
    expected = torch.cat((turned[:rotated_heads], heads_view[rotated_heads:])).view(1, -1)
    torch.testing.assert_close(got.float(), expected, atol=5e-2, rtol=2e-2)


def test_gemv_refuses_more_than_one_row():
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv.gemv(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="the cuBLAS-or-Triton choice is measured on a GPU")
def test_one_row_linear_picks_the_faster_path_and_matches_torch():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    linear = Linear(4096, 4096).to(device="cuda", dtype=torch.bfloat16)
    linear.weight.copy_(weight)
    choices = gemv.choose_matvec_kernels(linear)
    assert choices == {(4096, 4096, torch.bfloat16): linear.use_gemv}  # measured, then set on the module
    got = linear(x)
    torch.testing.assert_close(got.float(), (x.float() @ weight.float().T), atol=3e-2, rtol=1e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the one-row matvec serves CUDA half types")
def test_one_row_gated_linear_matches_the_linear_then_the_activation():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * 1024, 4096, device="cuda", dtype=torch.bfloat16) / 64
    got = ops.linear_silu_and_mul(x, weight)
    torch.testing.assert_close(got, ops.silu_and_mul(ops.linear(x, weight)), atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the one-row matvec serves CUDA half types")
def test_one_row_linear_rotary_matches_the_linear_then_the_rotary():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(6 * 128, 4096, device="cuda", dtype=torch.bfloat16) / 64
    angles = torch.rand(1, 64, device="cuda").repeat(1, 2) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    got = ops.linear_rotary(x, weight, None, ops.HeadRotation(cos, sin, 5, 128))
    expected = ops.linear(x, weight)
    ops.rotary(expected[:, : 5 * 128].view(1, 5, 128), cos, sin)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=1e-2)


def test_timing_rotates_over_copies_that_outgrow_the_cache_unless_the_weight_already_does():
    small = torch.zeros(256, 1024)  # 1 MiB: as many copies as timed calls
    copies = gemv._weights_beyond_cache(small)
    assert len(copies) == gemv.TIMING_REPEATS and copies[0] is small
    assert len({c.data_ptr() for c in copies}) == len(copies) and all(torch.equal(c, small) for c in copies)
    large = torch.empty(gemv._TIMED_BYTES // 4 + 1, dtype=torch.float32)  # past the timed bytes alone
    (only,) = gemv._weights_beyond_cache(large)
    assert only is large


def _norm_and_residual(dtype, k, n, norm_dtype):
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    norm = ops.RowNorm((1 + 0.3 * torch.randn(k, device=DEVICE)).to(norm_dtype), 1e-5)
    residual = torch.randn(1, n, device=DEVICE).to(dtype)
    return x, norm, residual


def _close_to_a_rounding(got, expected):
    # The folded norm sums x's squares in its own order: the last bit of a half type may move.
    half = got.dtype != torch.float32
    torch.testing.assert_close(got, expected, atol=3e-2 if half else 1e-5, rtol=1e-2 if half else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_dtype", ["model", torch.float32])  # an offset norm's weight is float32
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), [(48, 160, 16, 64), (37, 100, 8, 128)])
def test_gemv_folds_the_input_norm_and_the_residual_add(dtype, norm_dtype, n, k, block_n, block_k):
    """gemv with `norm` and `residual` against the norm's own kernel, the matvec, then the add
    (rounded as the norm kernel adds a residual): x spanning several blocks and a ragged one."""
    torch.manual_seed(n + k)
    x, norm, residual = _norm_and_residual(dtype, k, n, dtype if norm_dtype == "model" else norm_dtype)
    weight = torch.randn(n, k, device=DEVICE).to(dtype)
    config = triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k})
    normed = fused.rms_norm(x, norm.weight, norm.eps)
    separate = gemv.gemv(normed, weight, config=config)
    _close_to_a_rounding(gemv.gemv(x, weight, config=config, norm=norm), separate)
    summed = (separate.float() + residual.float()).to(dtype)
    _close_to_a_rounding(gemv.gemv(x, weight, config=config, norm=norm, residual=residual), summed)
    assert torch.equal(gemv.gemv(normed, weight, config=config, residual=residual), summed)
    # A bias beside the residual joins the rounded product, as a row-parallel linear adds it.
    bias = torch.randn(n, device=DEVICE).to(dtype)
    with_bias = ((separate.float() + bias.float()).to(dtype).float() + residual.float()).to(dtype)
    assert torch.equal(gemv.gemv(normed, weight, bias, config=config, residual=residual), with_bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_silu_and_mul_and_gemv_rotary_fold_the_input_norm(dtype):
    torch.manual_seed(5)
    head_dim, k = 16, 72
    x, norm, _ = _norm_and_residual(dtype, k, 1, dtype)
    normed = fused.rms_norm(x, norm.weight, norm.eps)
    config = triton.Config({"BLOCK_N": 8, "BLOCK_K": 32})
    gate_up = torch.randn(80, k, device=DEVICE).to(dtype)
    expected = gemv.gemv_silu_and_mul(normed, gate_up, config=config)
    _close_to_a_rounding(gemv.gemv_silu_and_mul(x, gate_up, config=config, norm=norm), expected)
    qkv = torch.randn(4 * head_dim, k, device=DEVICE).to(dtype)
    angles = torch.rand(1, head_dim // 2, device=DEVICE).repeat(1, 2) * 6
    rotation = ops.HeadRotation(angles.cos().to(dtype), angles.sin().to(dtype), 3, head_dim)
    expected = gemv.gemv_rotary(normed, qkv, None, rotation, config=config)
    _close_to_a_rounding(gemv.gemv_rotary(x, qkv, None, rotation, config=config, norm=norm), expected)


def test_the_folded_linear_normalises_and_adds_where_it_takes_no_matvec():
    """ops.linear's other paths (here torch's, on the CPU) normalise first and add after."""
    torch.manual_seed(6)
    x, norm, residual = _norm_and_residual(torch.float32, 24, 10, torch.float32)
    x = x.cpu().repeat(3, 1)
    norm, residual = ops.RowNorm(norm.weight.cpu(), norm.eps), residual.cpu()
    weight = torch.randn(10, 24)
    got = ops.linear(x, weight, norm=norm, residual=residual)
    expected = ops.linear(ops.rms_norm(x, norm.weight, norm.eps), weight) + residual
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_weights_fold_the_norm_residual_rotary_and_activation_at_one_row(dtype):
    """A float8 weight at one row takes the folded matvecs a dense one takes (its values, times
    each row's scale): each gives what the same op gives on the dequantized weight."""
    torch.manual_seed(7)
    head_dim, k = 16, 72
    x, norm, residual = _norm_and_residual(dtype, k, 40, dtype)
    config = triton.Config({"BLOCK_N": 8, "BLOCK_K": 32})

    def packed_and_dense(rows):
        # Rows of very different sizes: a scale left out or misplaced moves the outputs.
        packed = quantize_fp8(torch.randn(rows, k, device=DEVICE) * torch.logspace(-1, 1, rows, device=DEVICE)[:, None])
        return packed, (packed.values.float() * packed.scales[:, None]).to(dtype)

    out, out_dense = packed_and_dense(40)
    got = gemv.gemv(x, out.values, config=config, scale=out.scales, norm=norm, residual=residual)
    _close_to_a_rounding(got, gemv.gemv(x, out_dense, config=config, norm=norm, residual=residual))
    gate_up, gate_up_dense = packed_and_dense(80)
    got = gemv.gemv_silu_and_mul(x, gate_up.values, config=config, norm=norm, scale=gate_up.scales)
    _close_to_a_rounding(got, gemv.gemv_silu_and_mul(x, gate_up_dense, config=config, norm=norm))
    qkv, qkv_dense = packed_and_dense(4 * head_dim)
    angles = torch.rand(1, head_dim // 2, device=DEVICE).repeat(1, 2) * 6
    rotation = ops.HeadRotation(angles.cos().to(dtype), angles.sin().to(dtype), 3, head_dim)
    got = gemv.gemv_rotary(x, qkv.values, None, rotation, config=config, norm=norm, scale=qkv.scales)
    _close_to_a_rounding(got, gemv.gemv_rotary(x, qkv_dense, None, rotation, config=config, norm=norm))


def test_a_float8_weight_hands_its_values_and_scales_to_the_matvec_at_one_row_only():
    linear = Linear(64, 32).to(DEVICE)
    linear.weight.data.normal_()
    linear.quantize("fp8")
    packed = linear.weight
    x = torch.randn(1, 64, device=DEVICE).to(DTYPES[0])
    with kernels_on_cpu() if DEVICE == "cpu" else nullcontext():
        values, scales = ops.matvec_operands(x, packed, use_gemv=False)  # whatever the dense choice
        assert values is packed.values and scales is packed.scales
        assert ops.matvec_operands(x.repeat(2, 1), packed, use_gemv=True) is None  # the few-rows kernel's
        assert linear.folds(x) and not linear.folds(x.repeat(2, 1))
    assert DEVICE == "cuda" or ops.matvec_operands(x, packed, use_gemv=True) is None  # the CPU's torch path
