"""A Triton matrix-vector product for one-row linears (decoding a single request).

At one row a linear layer is a pure weight read, and cuBLAS leaves bandwidth behind: on the
H200 its one-row kernels read Llama-3-8B's weights at 2.5 (o_proj) to 4.4 TB/s (LM head).
This kernel gives each program one or two output rows and reads their whole width in one or
two blocks of up to 4096 columns, which keeps many loads in flight per multiprocessor: it
reads the same weights at 3.2 to 4.6 TB/s (`scripts/gemv_bench.py --sweep`).

Whether it beats cuBLAS depends on the shape and the GPU, so it is not assumed: the first
time a weight shape is seen outside graph capture, both are timed on the device alone (queued
behind a device-side sleep, so host launch costs do not count, as in the decode graphs) and
the faster one is kept for that shape (`prefers_gemv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TIMING_REPEATS = 20


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n] = sum_k w[n, k] * x[k] (+ bias[n]), float32 accumulation, for BLOCK_N rows per program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        in_cols = cols < K
        x = tl.load(x_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + rows[:, None] * stride_w + cols[None, :], mask=in_rows[:, None] & in_cols[None, :], other=0.0
        )
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=in_rows)


_CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps)
    # The best of a wide sweep on the H200, for every Llama-3-8B shape.
    for block_n, block_k, warps in [(1, 4096, 8), (1, 2048, 4), (2, 2048, 8), (2, 1024, 4)]
]
_tuned_gemv_kernel = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_gemv_kernel)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: triton.Config | None = None
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N]. The launch configuration is autotuned
    per shape unless given (tests, sweeps)."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, {k}] and a row-major weight; got x {tuple(x.shape)}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    x = x.contiguous()
    # Without a bias the kernel never reads its bias pointer; `out` stands in for it.
    args = (x, weight, out if bias is None else bias, out, n, k, weight.stride(0))
    if config is None:
        _tuned_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None)
    else:
        grid = (triton.cdiv(n, config.kwargs["BLOCK_N"]),)
        _gemv_kernel[grid](*args, HAS_BIAS=bias is not None, **config.all_kwargs())
    return out


_preference: dict[tuple[int, int, torch.dtype, torch.device], bool] = {}


def prefers_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this one-row linear should run on `gemv` rather than cuBLAS (measured once per
    weight shape; cuBLAS while a graph is being captured and no measurement exists)."""
    key = (weight.shape[0], weight.shape[1], weight.dtype, weight.device)
    choice = _preference.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        weights = _weights_beyond_cache(weight)
        choice = _preference[key] = _milliseconds(x, weights, _triton) < _milliseconds(x, weights, _cublas)
    return choice


def _cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


def _triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gemv(x, weight)


# Decode reads each layer's weight once per step, from memory: the L2 cache (50 MB on the
# H200) cannot keep it between steps. Timing one weight again and again would read it from L2
# instead, so the calls rotate over copies that together are several times the cache.
_TIMED_BYTES = 256 * 2**20


def _weights_beyond_cache(weight: torch.Tensor) -> list[torch.Tensor]:
    weight_bytes = weight.numel() * weight.element_size()
    copies = min(TIMING_REPEATS, -(-_TIMED_BYTES // weight_bytes))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


# Cycles of a device-side sleep queued before the timed calls (about 5 ms on a 2 GHz GPU):
# the host queues every call while the device sleeps, so they then run back to back.
_QUEUE_AHEAD_CYCLES = 10_000_000


def _milliseconds(x: torch.Tensor, weights: list[torch.Tensor], matvec) -> float:
    """Device time of TIMING_REPEATS back-to-back `matvec(x, weight)` calls over `weights` in
    turn. Decode steps replay these linears from CUDA graphs, without host launch costs; timed
    naively, a small kernel would measure the host's launch cost rather than its own."""
    matvec(x, weights[0])  # compiles and autotunes first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_QUEUE_AHEAD_CYCLES)
    start.record()
    for repeat in range(TIMING_REPEATS):
        matvec(x, weights[repeat % len(weights)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
