"""Float8 matmuls on CUDA for weights quantized to e4m3 with a scale per output row.

A step of many rows quantizes its activations per row (dynamic, per token: each row's
largest magnitude maps to e4m3's largest value, 448) in one Triton launch, then multiplies
on the float8 tensor cores through `torch._scaled_mm` (cuBLASLt / CUTLASS with row-wise
scales): out = (x_q * x_scale) @ (w_q * w_scale).T. A one-row step is a pure weight read, so
it takes the Triton matvec over the float8 weight with bf16 activations (layers/gemv.py); so
is a step of a few rows (`FP8_FEW_ROWS`), which `few_rows_linear` multiplies on the tensor cores
with the weights widened in registers, each read once for all the rows: through cuBLASLt at
eight rows a Llama-3-8B FP8 decode step took 5.7 ms on an H100, where one row took 3.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs
from kestrel.layers import gemv
from kestrel.layers.quantized import FP8_FEW_ROWS

E4M3_MAX = tl.constexpr(448.0)
# A row of zeros still gets a usable scale (its values quantize to zero either way).
MIN_SCALE = tl.constexpr(1e-12)
E4M3_SMALLEST_NORMAL = tl.constexpr(2.0**-6)  # below it e4m3 is evenly spaced, 2**-9 apart
E4M3_SUBNORMAL_SHIFT = tl.constexpr(1.5 * 2.0**14)  # float32 values near it are 2**-9 apart


@triton.jit
def _round_to_e4m3(x):
    """x (float32, within e4m3's range) rounded to the nearest e4m3 value, ties to even, as
    torch rounds. Converting the result to e4m3 is then exact: the GPU's own conversion
    rounds through float16 first, and that double rounding moved about one value in 1,500
    to the other neighbour."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal values: keep 3 of float32's 23 mantissa bits, rounding the 20 dropped to even.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = kept.to(tl.float32, bitcast=True)
    # Below e4m3's normals: float32's own rounding at a magnitude whose spacing is 2**-9.
    subnormal = (x + E4M3_SUBNORMAL_SHIFT) - E4M3_SUBNORMAL_SHIFT
    return tl.where(tl.abs(x) < E4M3_SMALLEST_NORMAL, subnormal, normal)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_out,
    BLOCK_K: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One row: scale = max|x| / 448, out = x / scale in e4m3 (round to nearest). WHOLE_ROW
    (BLOCK_K covers K) keeps the row in registers between the two steps: one read of it, and
    no second round of load latency, which is what a 4,096-column row's time went to."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_out
    wait_for_inputs(DEPENDENT)
    if WHOLE_ROW:
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = _row_scale(tl.abs(x))
        tl.store(scale_ptr + row, scale)
        tl.store(out_row + cols, _to_e4m3(x, scale).to(out_ptr.dtype.element_ty), mask=cols < K)
    else:
        largest = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0)
            largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
        scale = _row_scale(largest)
        tl.store(scale_ptr + row, scale)
        for start in range(0, K, BLOCK_K):
            x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
            tl.store(out_row + start + cols, _to_e4m3(x, scale).to(out_ptr.dtype.element_ty), mask=start + cols < K)


@triton.jit
def _row_scale(magnitudes):
    return tl.maximum(tl.math.div_rn(tl.max(magnitudes, axis=0), tl.full([], E4M3_MAX, tl.float32)), MIN_SCALE)


@triton.jit
def _to_e4m3(x, scale):
    # IEEE division: `/` is approximate on the GPU.
    return _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -E4M3_MAX, E4M3_MAX))


# Widest row a program holds in registers: 32 float32 values a thread at 16 warps.
WHOLE_ROW_LIMIT = 16384


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (e4m3 values [rows, K], float32 scales [rows, 1]), one launch."""
    rows, k = x.shape
    values = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        row_block = triton.next_power_of_2(k)
        whole_row = row_block <= WHOLE_ROW_LIMIT
        block_k = row_block if whole_row else 2048
        _quantize_rows_kernel[(rows,)](
            x,
            values,
            scales,
            k,
            x.stride(0),
            values.stride(0),
            BLOCK_K=block_k,
            WHOLE_ROW=whole_row,
            # About 16 values a thread: registers enough for the row and the rounding's temporaries.
            num_warps=max(4, min(16, block_k // 512)),
            **dependent_launch_args(x.device),
        )
    return values, scales


@dataclass(frozen=True)
class FewRowsLaunch:
    """Output columns (weight rows) per program, columns read per step, warps, stages, and the
    programs a column block's reduction is split over (`splits`: partial sums in float32, then
    one launch adds them; None picks it by `reduction_splits`). The default was the best of 16
    launches (`gemv_bench --float8 --few-rows`, H100) for each of Llama-3-8B's projections at 2
    to 16 rows, with the splits that rule picks."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    splits: int | None = None


# Programs a launch wants: about four a multiprocessor on an H100 or H200 (132 of them). With
# fewer, each program's long reduction is one stream of loads; an unsplit 4,096-output
# projection (128 column blocks) read at a third of the copy rate.
FEW_ROWS_PROGRAMS = 512
MAX_SPLITS = 8


def reduction_splits(column_blocks: int) -> int:
    """The largest power of two (at most MAX_SPLITS) that keeps the launch within
    FEW_ROWS_PROGRAMS: Llama-3-8B's o and down projections split 4 ways, qkv 2, gate/up not."""
    splits = 1
    while splits < MAX_SPLITS and column_blocks * splits * 2 <= FEW_ROWS_PROGRAMS:
        splits *= 2
    return splits


@triton.jit
def _few_rows_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_x,
    stride_w,
    stride_out,
    stride_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """out[split, m, n] = (x[m, ks] . w[n, ks]) * scale[n] for the M (at most BLOCK_M) rows of
    x over the split's K_PER_SPLIT columns ks (all K when unsplit): a program reads its BLOCK_N
    float8 weight rows once, widened to x's dtype for the tensor cores (exact: every e4m3 value
    is a bf16 one), float32 accumulation."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    depth = tl.arange(0, BLOCK_K)
    in_cols, in_rows = cols < N, rows < M
    w_rows = w_ptr + cols[:, None] * stride_w
    x_rows = x_ptr + rows[:, None] * stride_x
    end = tl.minimum(K, (split + 1) * K_PER_SPLIT)
    wait_for_inputs(DEPENDENT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(split * K_PER_SPLIT, end, BLOCK_K):
        block = start + depth
        in_depth = (block < end)[None, :]
        w = tl.load(w_rows + block[None, :], mask=in_cols[:, None] & in_depth, other=0.0)
        x = tl.load(x_rows + block[None, :], mask=in_rows[:, None] & in_depth, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc *= tl.load(scale_ptr + cols, mask=in_cols, other=0.0)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    out_rows = out_ptr + split * stride_split + rows[:, None] * stride_out
    tl.store(out_rows + cols[None, :], out, mask=in_rows[:, None] & in_cols[None, :])


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    """out = the sum of SPLITS float32 partials [SPLITS, numel], in split order (the same sum
    on every run), in out's dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    wait_for_inputs(DEPENDENT)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(partial_ptr + split * numel + offsets, mask=inside, other=0.0)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=inside)


def few_rows_linear(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, launch: FewRowsLaunch | None = None
) -> torch.Tensor:
    """x [rows <= FP8_FEW_ROWS, K] @ (values * scales[:, None]).T in x's dtype, bf16 activations as
    they are (as the one-row matvec takes them). `launch` overrides the default (sweeps)."""
    x = x.contiguous()
    rows, k = x.shape
    n = values.shape[0]
    launch = launch or FewRowsLaunch()
    column_blocks = triton.cdiv(n, launch.block_n)
    wanted = launch.splits or reduction_splits(column_blocks)
    steps = triton.cdiv(k, launch.block_k)
    steps_per_split = triton.cdiv(steps, wanted)
    splits = triton.cdiv(steps, steps_per_split)  # none left empty
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    partials = out if splits == 1 else torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    _few_rows_kernel[(column_blocks, splits)](
        x,
        values,
        scales,
        partials,
        rows,
        n,
        k,
        steps_per_split * launch.block_k,
        x.stride(0),
        values.stride(0),
        n,
        rows * n,
        BLOCK_M=FP8_FEW_ROWS,  # tl.dot's least tile height: one tile holds every row
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **dependent_launch_args(x.device),
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(rows * n, block),)](
            partials, out, rows * n, SPLITS=splits, BLOCK=block, **dependent_launch_args(x.device)
        )
    return out


def fp8_linear(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, K] (bf16 or fp16) @ (values * scales[:, None]).T (+ bias), in x's dtype."""
    if x.shape[0] == 1:
        return gemv.gemv(x, values, bias, scale=scales)
    if x.shape[0] <= FP8_FEW_ROWS:
        out = few_rows_linear(x, values, scales)
        return out if bias is None else out + bias
    quantized, row_scales = quantize_rows(x)
    # Row-wise scales take a bf16 output (cuBLASLt / CUTLASS); other dtypes are cast from it.
    out = torch._scaled_mm(
        quantized, values.t(), scale_a=row_scales, scale_b=scales.view(1, -1), out_dtype=torch.bfloat16
    ).to(x.dtype)
    return out if bias is None else out + bias
