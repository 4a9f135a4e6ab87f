"""A Triton matrix-vector product for one-row linears (decoding a single request).

At one row a linear layer is a pure weight read, and cuBLAS leaves bandwidth behind: on the
H200 its one-row kernels read Llama-3-8B's weights at 2.5 (o_proj) to 4.4 TB/s (LM head).
This kernel gives each program one or two output rows and reads their whole width in one or
two blocks of up to 4096 columns, which keeps many loads in flight per multiprocessor: it
reads the same weights at 3.2 to 4.6 TB/s (`scripts/gemv_bench.py --sweep`).

Whether it beats cuBLAS depends on the shape and the GPU, so it is not assumed: at start-up,
before graphs are captured, `choose_matvec_kernels` times both on each weight shape of the
model, on the device alone (queued behind a device-side sleep, so host launch costs do not
count, as in the decode graphs), and sets each linear's `use_gemv` to the faster one. The
choice is explicit state of the model, fixed before capture, never filled in during a forward.

`gemv_silu_and_mul` is the MLP's gate and up projection with its activation: each program
reads the gate row and the up row of its outputs and writes silu(gate) * up, so one kernel
(and one launch) does what a linear and `silu_and_mul` did. `gemv_rotary` is the attention's
qkv projection with the rotary embedding of its query and key heads: each program reads the
two rows, d and d + head_dim / 2 of a head, that rotate together.

Each of them may also fold the RMSNorm before it (`ops.RowNorm`): every program normalises
the row itself as it reads it (`row_dots`; the row is a few KB, read from L2 by every
program anyway), so the norm costs neither a launch nor a wait. `gemv` may add the residual
after it, as the norm after it would have. A decoder layer at one row then runs no norm
kernel at all (DecoderLayer.forward_folded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs
from kestrel.layers.fused import rotate_half_pair
from kestrel.layers.ops import HeadRotation, RowNorm

TIMING_REPEATS = 20
GEMV_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _inverse_rms(first_block, x_ptr, K, eps, BLOCK_K: tl.constexpr):
    """1 / the root mean square of x [K] (plus eps), as fused.rms_norm computes it, from x's
    first block as loaded and the later blocks (none where one block holds x)."""
    cols = tl.arange(0, BLOCK_K)
    first = first_block.to(tl.float32)
    squares = first * first
    for start in range(BLOCK_K, K, BLOCK_K):
        x = tl.load(x_ptr + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        squares += x * x
    return 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def _input_block(x, norm_ptr, block, K, inverse_rms, NORMED: tl.constexpr):
    """x's columns `block` (x as loaded) in float32; NORMED, RMS-normalised and weighted by
    norm [K], rounded where fused.rms_norm rounds (so its output and this agree to the bit,
    but for the order of the squares' sum)."""
    values = x.to(tl.float32)
    if NORMED:
        normed = (values * inverse_rms).to(x.dtype).to(tl.float32)
        weight = tl.load(norm_ptr + block, mask=block < K, other=0.0).to(tl.float32)
        values = (weight * normed).to(x.dtype).to(tl.float32)
    return values


@triton.jit
def row_dots(
    x_ptr,
    w_ptr,
    rows,
    in_rows,
    K,
    stride_w,
    pair_offset,
    norm_ptr,
    eps,
    PAIRED: tl.constexpr,
    NORMED: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Float32 dots of x [K] with the weight rows `rows` and, PAIRED, with the rows
    `pair_offset` further on; NORMED, of RMSNorm(x) with weight norm [K] and `eps` (every
    program normalises x itself: the norm costs no launch, nor any program a wait). The
    first block of weights is requested before waiting for x (which the kernel before this
    one wrote: dependent_launch); the rest as they come."""
    cols = tl.arange(0, BLOCK_K)
    first_rows = w_ptr + rows[:, None] * stride_w
    paired_rows = first_rows + pair_offset * stride_w
    mask = in_rows[:, None] & (cols < K)[None, :]
    weights = tl.load(first_rows + cols[None, :], mask=mask, other=0.0)
    paired_weights = weights
    if PAIRED:
        paired_weights = tl.load(paired_rows + cols[None, :], mask=mask, other=0.0)
    wait_for_inputs(DEPENDENT)
    first_block = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    inverse_rms = 1.0
    if NORMED:
        inverse_rms = _inverse_rms(first_block, x_ptr, K, eps, BLOCK_K)
    x = _input_block(first_block, norm_ptr, cols, K, inverse_rms, NORMED)
    dots = tl.sum(weights.to(tl.float32) * x[None, :], axis=1)
    paired_dots = dots
    if PAIRED:
        paired_dots = tl.sum(paired_weights.to(tl.float32) * x[None, :], axis=1)
    for start in range(BLOCK_K, K, BLOCK_K):
        block = start + cols
        mask = in_rows[:, None] & (block < K)[None, :]
        x = _input_block(tl.load(x_ptr + block, mask=block < K, other=0.0), norm_ptr, block, K, inverse_rms, NORMED)
        weights = tl.load(first_rows + block[None, :], mask=mask, other=0.0)
        dots += tl.sum(weights.to(tl.float32) * x[None, :], axis=1)
        if PAIRED:
            paired_weights = tl.load(paired_rows + block[None, :], mask=mask, other=0.0)
            paired_dots += tl.sum(paired_weights.to(tl.float32) * x[None, :], axis=1)
    return dots, paired_dots


@triton.jit
def add_residual(values, residual_ptr, rows, in_rows, dtype: tl.constexpr):
    """values rounded to `dtype`, plus the residual rows, rounded again: the residual add
    as fused.rms_norm does it, so a matvec that adds it gives the bits the norm would."""
    residual = tl.load(residual_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    return (values.to(dtype).to(tl.float32) + residual).to(dtype)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    scale_ptr,
    norm_ptr,
    residual_ptr,
    N,
    K,
    stride_w,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORMED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n] = sum_k w[n, k] * x[k] (* scale[n]) (+ bias[n]) (+ residual[n]), float32
    accumulation, for BLOCK_N rows per program. With HAS_SCALE the weight is float8 with a
    scale per row; NORMED, x is RMS-normalised first (`row_dots`). With HAS_RESIDUAL the
    bias joins after the product is rounded, as a row-parallel linear adds its bias to the
    ranks' rounded sum; otherwise before, as cuBLAS adds it."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    acc, _ = row_dots(
        x_ptr, w_ptr, rows, in_rows, K, stride_w, 0, norm_ptr, eps, False, NORMED, DEPENDENT, BLOCK_N, BLOCK_K
    )
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + rows, mask=in_rows, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) + bias if HAS_RESIDUAL else acc + bias
    out = acc.to(dtype)
    if HAS_RESIDUAL:
        out = add_residual(acc, residual_ptr, rows, in_rows, dtype)
    tl.store(out_ptr + rows, out, mask=in_rows)


@triton.jit
def _gemv_silu_and_mul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    norm_ptr,
    WIDTH,
    K,
    stride_w,
    eps,
    HAS_SCALE: tl.constexpr,
    NORMED: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n] = silu(gate[n]) * up[n], where gate = w[:WIDTH] @ x and up = w[WIDTH:] @ x
    (NORMED: of RMSNorm(x), `row_dots`; HAS_SCALE: a float8 weight, each row's dot times its
    scale)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < WIDTH
    gate, up = row_dots(
        x_ptr, w_ptr, rows, in_rows, K, stride_w, WIDTH, norm_ptr, eps, True, NORMED, DEPENDENT, BLOCK_N, BLOCK_K
    )
    if HAS_SCALE:
        gate *= tl.load(scale_ptr + rows, mask=in_rows, other=0.0)
        up *= tl.load(scale_ptr + WIDTH + rows, mask=in_rows, other=0.0)
    # Rounded where the separate linear and activation round, so both paths give the same bits.
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows, (activated * up).to(dtype), mask=in_rows)


@triton.jit
def _gemv_rotary_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    scale_ptr,
    norm_ptr,
    PAIRS,
    K,
    stride_w,
    ROTATED_ROWS,
    eps,
    HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORMED: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """w @ x (+ bias) for the row pairs (d, d + HALF) of each head (NORMED: w @ RMSNorm(x),
    `row_dots`; HAS_SCALE: a float8 weight, each row's dot times its scale); pairs in the
    first ROTATED_ROWS rows are then rotated by cos/sin [1, 2 * HALF] (rotate-half layout)."""
    pairs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = pairs < PAIRS
    half = pairs % HALF
    first_rows = pairs // HALF * (2 * HALF) + half
    first, second = row_dots(
        x_ptr, w_ptr, first_rows, in_rows, K, stride_w, HALF, norm_ptr, eps, True, NORMED, DEPENDENT, BLOCK_N, BLOCK_K
    )
    if HAS_SCALE:
        first *= tl.load(scale_ptr + first_rows, mask=in_rows, other=0.0)
        second *= tl.load(scale_ptr + first_rows + HALF, mask=in_rows, other=0.0)
    if HAS_BIAS:
        first += tl.load(bias_ptr + first_rows, mask=in_rows, other=0.0).to(tl.float32)
        second += tl.load(bias_ptr + first_rows + HALF, mask=in_rows, other=0.0).to(tl.float32)
    # Rounded where the linear and the rotary kernel round (fused.rotary_), for the same bits.
    first = first.to(out_ptr.dtype.element_ty)
    second = second.to(out_ptr.dtype.element_ty)
    rotated = in_rows & (first_rows < ROTATED_ROWS)
    new_first, new_second = rotate_half_pair(first, second, cos_ptr, sin_ptr, half, rotated, HALF)
    tl.store(out_ptr + first_rows, tl.where(rotated, new_first, first), mask=in_rows)
    tl.store(out_ptr + first_rows + HALF, tl.where(rotated, new_second, second), mask=in_rows)


MATVEC_CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps)
    # The best of a wide sweep on the H200 for every Llama-3-8B shape, then (on an H100) for
    # the 2048-column weights of Qwen3-30B-A3B and Qwen3-Next: their qkv rows read 2.39 TB/s
    # among the first four, 2.69 at four rows of 1024-column blocks (scripts/gemv_bench.py).
    # The last four load twice the elements a program: a float8 element is half a bf16 one,
    # and the float8 matvec's best launches on an H100 were among them (`gemv_bench
    # --float8`; Llama-3-8B FP8 at one request 3.44 ms against 3.52-3.57 without them).
    for block_n, block_k, warps in [(1, 4096, 8), (1, 2048, 4), (2, 2048, 8), (2, 1024, 4), (4, 1024, 4), (8, 512, 4)]
    + [(2, 4096, 8), (4, 2048, 8), (1, 8192, 8), (4, 4096, 8)]
]
# Where the kernels run under Triton's interpreter (tests): small blocks, so that rows and
# columns of the tiny test models span several blocks, ragged ones too.
INTERPRETER_CONFIG = triton.Config({"BLOCK_N": 4, "BLOCK_K": 64})
# A folded norm reads the norm's weight beside x: its launches are tuned apart.
_tuned_gemv_kernel = triton.autotune(configs=MATVEC_CONFIGS, key=["N", "K", "NORMED"])(_gemv_kernel)
_tuned_silu_and_mul_kernel = triton.autotune(configs=MATVEC_CONFIGS, key=["WIDTH", "K", "NORMED"])(
    _gemv_silu_and_mul_kernel
)
_tuned_rotary_kernel = triton.autotune(configs=MATVEC_CONFIGS, key=["PAIRS", "K", "NORMED"])(_gemv_rotary_kernel)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
    scale: torch.Tensor | None = None,
    norm: RowNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N]; with `scale` [N] (float32), each row's
    dot times its scale (a float8 weight); with `norm`, of norm(x), computed by every program
    as it reads x; with `residual` [1, N], plus that, rounded as a row-parallel linear then
    the norm's residual add round (the product, plus the bias, plus the residual). The
    launch configuration is autotuned per shape unless given (tests, sweeps)."""
    n, k = _check_operands(x, weight)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    x = x.contiguous()
    # The kernel never reads the pointers of what is not given; `out` stands in.
    args = (x, weight, _or(bias, out), out, _or(scale, out), _norm_weight(norm, out), _or(residual, out), n, k)
    args += (weight.stride(0), _eps(norm))
    given = dict(HAS_BIAS=bias, HAS_SCALE=scale, NORMED=norm, HAS_RESIDUAL=residual)
    constants = {name: value is not None for name, value in given.items()}
    launch_rows(_gemv_kernel, _tuned_gemv_kernel, n, config, args, **constants)
    return out


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: triton.Config | None = None,
    norm: RowNorm | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up for x [1, K] (or norm(x)) and weight [2 * width, K] stacking the gate
    rows, then the up rows -> [1, width]; `scale` [2 * width] as `gemv` takes it."""
    rows, k = _check_operands(x, weight)
    if rows % 2:
        raise ValueError(f"gemv_silu_and_mul takes gate and up rows stacked; got {rows} rows")
    width = rows // 2
    out = torch.empty((1, width), dtype=x.dtype, device=x.device)
    args = (x.contiguous(), weight, out, _or(scale, out), _norm_weight(norm, out), width, k, weight.stride(0))
    args += (_eps(norm),)
    constants = dict(HAS_SCALE=scale is not None, NORMED=norm is not None)
    launch_rows(_gemv_silu_and_mul_kernel, _tuned_silu_and_mul_kernel, width, config, args, **constants)
    return out


def gemv_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rotation: HeadRotation,
    config: triton.Config | None = None,
    norm: RowNorm | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] (or norm(x)) @ weight[N, K].T (+ bias) -> [1, N], with `rotation` (cos and
    sin [1, head_dim]) applied to its first heads; `scale` [N] as `gemv` takes it."""
    head_dim, cos, sin = rotation.head_dim, rotation.cos, rotation.sin
    rows, k = _check_operands(x, weight)
    if rows % head_dim or head_dim % 2 or cos.shape != (1, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"gemv_rotary takes heads of {head_dim} rows and cos/sin [1, {head_dim}]")
    out = torch.empty((1, rows), dtype=x.dtype, device=x.device)
    pairs = rows // 2
    args = (x.contiguous(), weight, _or(bias, out), out, cos, sin, _or(scale, out), _norm_weight(norm, out), pairs, k)
    args += (weight.stride(0), rotation.heads * head_dim, _eps(norm))
    given = dict(HAS_BIAS=bias, HAS_SCALE=scale, NORMED=norm)
    constants = {name: value is not None for name, value in given.items()} | dict(HALF=head_dim // 2)
    launch_rows(_gemv_rotary_kernel, _tuned_rotary_kernel, pairs, config, args, **constants)
    return out


def _or(tensor: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    return stand_in if tensor is None else tensor


def _norm_weight(norm: RowNorm | None, stand_in: torch.Tensor) -> torch.Tensor:
    return stand_in if norm is None else norm.weight


def _eps(norm: RowNorm | None) -> float:
    return 0.0 if norm is None else norm.eps


def launch_rows(kernel, tuned_kernel, units: int, config: triton.Config | None, args: tuple, **constants) -> None:
    """`units` outputs (rows, or row pairs), BLOCK_N per program: the autotuned kernel, or the
    plain one with `config`. Launched as dependent where the GPU allows (dependent_launch)."""
    device = args[0].device
    constants.update(dependent_launch_args(device))
    if config is None and device.type != "cuda":
        config = INTERPRETER_CONFIG  # autotuning times launches on a GPU
    if config is None:
        tuned_kernel[lambda meta: (triton.cdiv(units, meta["BLOCK_N"]),)](*args, **constants)
    else:
        kernel[(triton.cdiv(units, config.kwargs["BLOCK_N"]),)](*args, **constants, **config.all_kwargs())


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, {k}] and a row-major weight; got x {tuple(x.shape)}")
    return n, k


def prefers_gemv(weight: torch.Tensor) -> bool:
    """Whether a one-row linear over `weight` runs faster on `gemv` than on cuBLAS, measured."""
    x = torch.randn((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    weights = _weights_beyond_cache(weight)
    return _milliseconds(x, weights, _triton) < _milliseconds(x, weights, _cublas)


def choose_matvec_kernels(model: torch.nn.Module) -> dict[tuple[int, int, torch.dtype], bool]:
    """Set `use_gemv` on every module of `model` that declares a `matvec_weight`, measured once
    per weight shape; returns the choices by (rows, columns, dtype)."""
    choices: dict[tuple[int, int, torch.dtype], bool] = {}
    for module in model.modules():
        weight = getattr(module, "matvec_weight", None)
        if (
            not isinstance(weight, torch.Tensor)
            or weight.dim() != 2
            or not weight.is_cuda
            or weight.dtype not in GEMV_DTYPES
        ):
            continue
        key = (weight.shape[0], weight.shape[1], weight.dtype)
        if key not in choices:
            choices[key] = prefers_gemv(weight)
        module.use_gemv = choices[key]
    return choices


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
