"""4-bit weight-only matmuls for CUDA (W4A16): the codes stay packed in memory and are widened
in registers, so a decode step reads a quarter of a bf16 weight's bytes (plus a scale and a
zero per group of 128 inputs: 4.25 bits a weight).

Layout (`Int4CudaWeight`): codes [out, in / 8] int32, nibble i of word j holding input column
8j + i; scales and zeros [out, in / group] in the model's dtype; a weight is
(code - 8) * scale + zero, the CPU format's arithmetic (layers/quantized.py), groups of 128 as
AWQ and GPTQ checkpoints use.

- `int4_gemv_kernel` (one row, decode): BLOCK_N output rows per program, BLOCK_K columns per
  step, float32 dots; the dense matvec's shape (layers/gemv.py), with the unpacking inside.
- `int4_matmul_kernel` (more rows): tiles of A times tiles of the weight widened to A's dtype,
  `tl.dot` on the tensor cores; each K step stays inside one group (BLOCK_K divides it), so a
  tile's scales and zeros are one row of each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs

ZERO_POINT = 8
GEMV_BLOCK_N, GEMV_BLOCK_K = 4, 1024
# Launches the one-row kernel is timed over on the GPU, per weight shape, at its first call
# (before any graph is captured): rows per program, columns per step, warps.
GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps)
    for block_n, block_k, warps in [(1, 2048, 4), (2, 2048, 4), (2, 4096, 8), (4, 1024, 4), (4, 2048, 8), (8, 1024, 8)]
]
MATMUL_BLOCKS = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64)


@triton.jit
def _unpack(words, ROWS: tl.constexpr, COLS: tl.constexpr, ALONG_ROWS: tl.constexpr):
    """int32 words holding 8 codes each -> the codes: [ROWS, COLS // 8] words laid out along
    their columns (ALONG_ROWS off), or [ROWS // 8, COLS] along their rows."""
    shifts = tl.arange(0, 8) * 4
    if ALONG_ROWS:
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    else:
        codes = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    return tl.reshape(codes, (ROWS, COLS))


@triton.jit
def _one_plus_sixteenth(words, NIBBLE: tl.constexpr):
    """1 + q / 16 as float32 for code q at nibble NIBBLE of each int32 word: q moved to
    mantissa bits 19-22 under the exponent of 1.0 (a shift and one masked or)."""
    SHIFT: tl.constexpr = 19 - 4 * NIBBLE
    if SHIFT >= 0:
        bits = words << SHIFT
    else:
        bits = words >> -SHIFT  # arithmetic for the top nibble: the mask drops the sign's copies
    return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def int4_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_codes,
    stride_groups,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """out[n] = x . w[n] for BLOCK_N rows n. Every tile stays [rows, words]: nibble j of each
    word meets x at column 8 word + j, eight times over (a [rows, words, 8] tile would spread
    one word's nibbles over threads that each load it). The dots are then summed per group of
    GROUP columns (BLOCK_K holds whole groups), whose scale and zero enter once:
    sum(((q - 8) s + z) x) = s (q . x) + (z - 8 s) sum(x).

    A code widens without an int-to-float conversion (a quarter-rate instruction, eight per
    word, which held the kernel below the bandwidth): moved into the top of a float's mantissa
    under 1.0's exponent it reads as 1 + q / 16, so the dots sum (1 + q / 16) x and
    q . x = 16 (that sum - sum(x))."""
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUP_WORDS: tl.constexpr = GROUP // 8
    BLOCK_GROUPS: tl.constexpr = BLOCK_K // GROUP
    tl.static_assert(BLOCK_K % GROUP == 0, "a block of columns holds whole groups")
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    words = tl.arange(0, WORDS)
    row_codes = codes_ptr + rows[:, None] * stride_codes
    row_groups = rows[:, None] * stride_groups
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # The first block of codes is requested before waiting for x (dependent_launch).
    packed = tl.load(row_codes + words[None, :], mask=in_rows[:, None] & (words < K // 8)[None, :], other=0)
    wait_for_inputs(DEPENDENT)
    for start in range(0, K // 8, WORDS):
        block = start + words
        in_block = block < K // 8
        code_dots = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_sums = tl.zeros((WORDS,), dtype=tl.float32)
        for nibble in tl.static_range(8):
            x = tl.load(x_ptr + block * 8 + nibble, mask=in_block, other=0.0).to(tl.float32)
            code_dots += _one_plus_sixteenth(packed, nibble) * x[None, :]
            x_sums += x
        group_dots = tl.sum(tl.reshape(code_dots, (BLOCK_N, BLOCK_GROUPS, GROUP_WORDS)), axis=2)
        group_x_sums = tl.sum(tl.reshape(x_sums, (BLOCK_GROUPS, GROUP_WORDS)), axis=1)
        groups = start // GROUP_WORDS + tl.arange(0, BLOCK_GROUPS)
        mask = in_rows[:, None] & (groups < K // GROUP)[None, :]
        scales = tl.load(scales_ptr + row_groups + groups[None, :], mask=mask, other=0.0).to(tl.float32)
        zeros = tl.load(zeros_ptr + row_groups + groups[None, :], mask=mask, other=0.0).to(tl.float32)
        # s (q . x) + (z - 8 s) sum(x), with q . x = 16 (group_dots - sum(x)).
        acc += tl.sum(16.0 * scales * group_dots + (zeros - 24.0 * scales) * group_x_sums[None, :], axis=1)
        following = block + WORDS
        packed = tl.load(row_codes + following[None, :], mask=in_rows[:, None] & (following < K // 8)[None, :], other=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=in_rows)


_tuned_gemv_kernel = triton.autotune(configs=GEMV_CONFIGS, key=["N", "K"])(int4_gemv_kernel)


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("M",))
def int4_matmul_kernel(
    a_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_a,
    stride_c,
    stride_codes,
    stride_groups,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """C = A @ W^T for a [BLOCK_M, BLOCK_N] tile; BLOCK_K divides GROUP, so each K step widens
    its weight tile with one scale and one zero per output column."""
    wait_for_inputs(DEPENDENT)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows, in_cols = rows < M, cols < N
    depth = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * stride_a + (start + depth)[None, :], mask=in_rows[:, None], other=0.0)
        packed = tl.load(
            codes_ptr + cols[None, :] * stride_codes + (start // 8 + words)[:, None], mask=in_cols[None, :], other=0
        )
        codes = _unpack(packed, BLOCK_K, BLOCK_N, True).to(tl.float32)
        group = start // GROUP
        scales = tl.load(scales_ptr + cols * stride_groups + group, mask=in_cols, other=0.0).to(tl.float32)
        zeros = tl.load(zeros_ptr + cols * stride_groups + group, mask=in_cols, other=0.0).to(tl.float32)
        weights = ((codes - 8.0) * scales[None, :] + zeros[None, :]).to(a.dtype)
        acc += tl.dot(a, weights, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rows[:, None] * stride_c + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=in_rows[:, None] & in_cols[None, :],
    )


def int4_linear_cuda(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias), W [N, K] held as 4-bit codes (module docstring)."""
    rows, depth = x.shape
    out_features = codes.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x.contiguous()
    common = dict(GROUP=group_size, HAS_BIAS=bias is not None, **dependent_launch_args(x.device))
    bias_arg = bias if bias is not None else out
    if rows == 1:
        args = (x, codes, scales, zeros, bias_arg, out, out_features, depth, codes.stride(0), scales.stride(0))
        if x.is_cuda:
            _tuned_gemv_kernel[lambda meta: (triton.cdiv(out_features, meta["BLOCK_N"]),)](*args, **common)
        else:  # Triton's interpreter: one launch shape, no timing
            block_k = min(GEMV_BLOCK_K, triton.next_power_of_2(depth))
            int4_gemv_kernel[(triton.cdiv(out_features, GEMV_BLOCK_N),)](
                *args, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=block_k, **common
            )
        return out
    blocks = MATMUL_BLOCKS
    grid = (triton.cdiv(rows, blocks["BLOCK_M"]), triton.cdiv(out_features, blocks["BLOCK_N"]))
    int4_matmul_kernel[grid](
        x, codes, scales, zeros, bias_arg, out, rows, out_features, depth, x.stride(0), out.stride(0),
        codes.stride(0), scales.stride(0), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **blocks, **common,
    )  # fmt: skip
    return out
