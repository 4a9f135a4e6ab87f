"""Kestrel's AVX-512 VNNI 4-bit matvec (layers/int4_cpu.py) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kestrel.core.runtime import cpu_kernels
from kestrel.layers import int4_cpu
from kestrel.layers.quantized import Int4VnniWeight, Int4Weight, int4_groups, int4_linear, quantize_int4

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="this CPU has no AVX-512 VNNI (or no compiler)")


def packed(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight's codes [out, in], and the kernel's codes and scales-and-zeros of them."""
    torch.manual_seed(seed)
    codes, scale, zero = int4_groups(torch.randn(out_features, in_features) * 0.05, int4_cpu.GROUP_SIZE)
    codes = codes.reshape(out_features, in_features)
    return (codes, *int4_cpu.pack(codes, scale, zero))


@pytest.mark.parametrize("in_features", [64, 128, 192, 576])
def test_packing_keeps_every_code(in_features):
    codes, kernel_codes, scales_and_zeros = packed(8, in_features)
    assert kernel_codes.shape == (8, in_features // 2) and kernel_codes.dtype == torch.uint8
    assert scales_and_zeros.shape == (2, 8, in_features // 32) and scales_and_zeros.dtype == torch.bfloat16
    assert torch.equal(int4_cpu.unpack(kernel_codes), codes.long())


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 64), (32, 192), (960, 576), (576, 1536), (4, 128)])
@pytest.mark.parametrize("rows", [1, 3, 15])
def test_the_kernel_computes_its_reference(out_features, in_features, rows):
    _, codes, scales_and_zeros = packed(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features)
    x[:, 5] = 40.0  # an outlier channel, as real activations have: its group's others keep their digits
    x[0, 32:64] = 0.0  # a group of zeros: its scale is zero
    got = int4_cpu.matvec(x, codes, scales_and_zeros)
    expected = int4_cpu.reference(x, codes, scales_and_zeros)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # float sums in another order


@pytest.mark.parametrize("outlier", [False, True])
def test_the_reference_is_closer_to_the_exact_product_than_bfloat16_activations(outlier):
    """Activations held as two int8 digits per value (about 14 bits of a group's largest): the
    product moves less than rounding the activations to bfloat16 (torch's kernel) moves it, by
    far where no outlier widens a group's steps."""
    _, codes, scales_and_zeros = packed(64, 192)
    x = torch.randn(4, 192)
    if outlier:
        x[:, 7] = 40.0
    weight = int4_cpu.dequantize(codes, scales_and_zeros)
    exact = x @ weight.t()
    error = (int4_cpu.reference(x, codes, scales_and_zeros) - exact).norm() / exact.norm()
    bf16_error = (x.bfloat16().float() @ weight.t() - exact).norm() / exact.norm()
    assert error < bf16_error / (1 if outlier else 10)


@needs_kernel
def test_quantized_linears_take_the_kernel_where_the_shape_fits():
    weight = torch.randn(64, 128)
    vnni = quantize_int4(weight)
    assert isinstance(vnni, Int4VnniWeight)
    assert isinstance(quantize_int4(torch.randn(64, 96)), Int4Weight)  # 96 columns: not whole blocks of 64
    x = torch.randn(2, 128)
    torch.testing.assert_close(int4_linear(x, vnni), int4_cpu.reference(x, vnni.codes, vnni.scales_and_zeros))


@needs_kernel
def test_a_compiled_function_calls_the_kernel():
    """torch.compile traces the op through its fake (shape-only) implementation."""
    weight = quantize_int4(torch.randn(32, 128))
    bias = torch.randn(32)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(int4_linear(x * 2, weight, bias))

    x = torch.randn(1, 128)
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(x), step(x))


def test_the_environment_can_ask_for_torch_s_kernel(monkeypatch):
    monkeypatch.setenv("KESTREL_CPU_KERNELS", "torch")
    cpu_kernels.available.cache_clear()
    try:
        assert not cpu_kernels.available()
        assert isinstance(quantize_int4(torch.randn(64, 128)), Int4Weight)
    finally:
        monkeypatch.delenv("KESTREL_CPU_KERNELS")
        cpu_kernels.available.cache_clear()
