"""Kestrel's CPU decode attention (core/runtime/cpu_kernels.py) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.attention.torch_ref import attention, decode_key_mask, first_visible_key, grouped_sinks
from kestrel.core.runtime import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="this CPU has no AVX-512 VNNI (or no compiler)")


def layer(**kinds) -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=6, num_kv_heads=2, head_dim=32, scale=32**-0.5, **kinds)


@pytest.mark.parametrize(
    "kinds",
    [{}, {"sliding_window": 5}, {"chunk_size": 8}, {"sliding_window": 20, "chunk_size": 16}],
    ids=["full", "window", "chunked", "window-and-chunk"],
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_matches_the_masked_reference(kinds, with_sinks):
    torch.manual_seed(0)
    spec = layer(**kinds)
    rows, capacity, group = 3, 40, spec.num_heads // spec.num_kv_heads
    keys = torch.randn(rows + 1, spec.num_kv_heads, capacity, spec.head_dim)  # mirrors hold a spare row
    values = torch.randn(rows + 1, spec.num_kv_heads, capacity, spec.head_dim)
    query = torch.randn(rows, spec.num_kv_heads, group, spec.head_dim)
    seq_lens = torch.tensor([1, 17, 33])
    sinks = torch.randn(spec.num_heads) if with_sinks else None
    row_sinks = grouped_sinks(sinks, spec)
    got = cpu_kernels.ops().decode_attention(
        query,
        keys,
        values,
        first_visible_key(seq_lens, spec),
        seq_lens,
        spec.scale,
        query.new_empty(0) if row_sinks is None else row_sinks.contiguous(),
    )
    width = int(seq_lens.max())
    mask = decode_key_mask(torch.arange(width), seq_lens, spec)[:, None, None, :]
    expected = attention(query, keys[:rows, :, :width], values[:rows, :, :width], mask, spec.scale, row_sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_first_visible_key_is_the_mask_s_first():
    seq_lens = torch.tensor([1, 4, 9, 30])
    for kinds in ({}, {"sliding_window": 3}, {"chunk_size": 8}, {"sliding_window": 6, "chunk_size": 4}):
        spec = layer(**kinds)
        mask = decode_key_mask(torch.arange(32), seq_lens, spec)
        expected = mask.int().argmax(dim=1)  # the first True
        assert torch.equal(first_visible_key(seq_lens, spec).clamp(min=0), expected), kinds


def test_a_compiled_function_calls_the_attention_kernel():
    spec = layer()
    keys, values = torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    seq_lens = torch.tensor([5, 16])

    def step(query: torch.Tensor) -> torch.Tensor:
        first, no_sinks = first_visible_key(seq_lens, spec), query.new_empty(0)
        return cpu_kernels.ops().decode_attention(query * 2, keys, values, first, seq_lens, spec.scale, no_sinks)

    query = torch.randn(2, 2, 3, 32)
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(query), step(query))


@pytest.mark.parametrize(("out_features", "in_features"), [(4, 16), (960, 576), (49152 // 8, 576)])
def test_the_float_matvec_is_the_product(out_features, in_features):
    torch.manual_seed(1)
    weight, x = torch.randn(out_features, in_features), torch.randn(1, in_features)
    assert cpu_kernels.takes_float_matvec(weight)
    torch.testing.assert_close(cpu_kernels.ops().float_matvec(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-4)


def test_one_row_linears_of_marked_weights_take_the_float_matvec():
    from kestrel.layers import ops
    from kestrel.layers.linear import Linear

    torch.manual_seed(2)
    layer = Linear(64, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    odd = Linear(64, 30)  # rows not in fours: left to torch
    odd.weight.data.normal_()
    model = torch.nn.ModuleList([layer, odd])
    assert cpu_kernels.choose_cpu_matvecs(model) == 1 and layer.use_gemv and not odd.use_gemv
    x = torch.randn(1, 64)
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias, rtol=1e-5, atol=1e-5)
    rows = torch.randn(3, 64)  # more than one row: torch's product
    torch.testing.assert_close(ops.linear(rows, layer.weight, use_gemv=True), rows @ layer.weight.t())


def test_a_failed_build_leaves_torch_s_ops_with_a_warning(monkeypatch, caplog):
    def no_compiler() -> None:
        raise OSError("c++: command not found")

    monkeypatch.setattr(cpu_kernels, "_build", no_compiler)
    cpu_kernels.available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kestrel"):
            assert not cpu_kernels.available()
        assert "could not be built; torch's ops are used instead" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.available.cache_clear()
        assert cpu_kernels.available()  # built before: loaded again


def test_an_unknown_choice_of_kernels_is_refused(monkeypatch):
    monkeypatch.setenv("KESTREL_CPU_KERNELS", "off")
    cpu_kernels.available.cache_clear()
    try:
        with pytest.raises(ValueError, match="KESTREL_CPU_KERNELS='off': expected 'kestrel'"):
            cpu_kernels.available()
    finally:
        monkeypatch.undo()
        cpu_kernels.available.cache_clear()
