"""The one-row Triton matvec against torch (the interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch
import triton

from kestrel.layers import gemv, ops

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


def test_gemv_refuses_more_than_one_row():
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv.gemv(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="the cuBLAS-or-Triton choice is measured on a GPU")
def test_one_row_linear_picks_the_faster_path_and_matches_torch():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    got = ops.linear(x, weight)
    key = (4096, 4096, torch.bfloat16, weight.device)
    assert key in gemv._preference  # measured once, then kept
    torch.testing.assert_close(got.float(), (x.float() @ weight.float().T), atol=3e-2, rtol=1e-2)


def test_timing_rotates_over_copies_that_outgrow_the_cache_unless_the_weight_already_does():
    small = torch.zeros(256, 1024)  # 1 MiB: as many copies as timed calls
    copies = gemv._weights_beyond_cache(small)
    assert len(copies) == gemv.TIMING_REPEATS and copies[0] is small
    assert len({c.data_ptr() for c in copies}) == len(copies) and all(torch.equal(c, small) for c in copies)
    large = torch.empty(gemv._TIMED_BYTES // 4 + 1, dtype=torch.float32)  # past the timed bytes alone
    (only,) = gemv._weights_beyond_cache(large)
    assert only is large
