"""Fused mixture of experts for CUDA: grouped Triton matmuls over tokens sorted by expert.

The (token, choice) assignments are grouped by expert on the device and each expert's run is
padded to a whole number of row blocks, so every block of rows belongs to one expert. One
kernel launch then computes every expert's gate/up projection, another every down
projection (scaled by the routing weight). All shapes depend only on the token count, never
on the routing, so nothing is read back to the host and a step can be captured in a graph.

Routing is one kernel (`route`: softmax, top-k, renormalisation and any always-on shared
expert per token), a program per token. For one row it is folded into the router's matvec
(`gemv_route`): the last of its programs to finish routes. The grouping is three small
kernels (count each expert's rows; lay out each expert's run; place each row), each spread
over many programs, not a sort: a decode step runs it in every layer, where a dozen torch
ops cost more than the matmuls' bytes. Where so few rows are routed that no expert is likely
to get two (a decode step of one or two requests), there is no grouping and no matmul tile:
each routed row is a matrix-vector product (`expert_matvecs`), the gate/up one with its
activation, the down one summing a token's experts as it reads them, so a decode layer's
experts cost two launches. Launch shapes come from a table per run length (`moe_launch`),
which scripts/moe_sweep.py measures per GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs, wait_then_release
from kestrel.layers.gemv import MATVEC_CONFIGS, add_residual, launch_rows, row_dots
from kestrel.layers.ops import RowNorm, rms_norm

# Per-row float32 scales of w13 and w2 where the experts are float8, else None.
ExpertScales = tuple[torch.Tensor | None, torch.Tensor | None]

SILU, CLAMPED_SWIGLU = 0, 1  # the experts' activations (kernel constants)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GPT-OSS's gate slope and clamp


@dataclass(frozen=True)
class ExpertForm:
    """What a family's experts compute besides silu(gate) * up summed by routing weight:
    GPT-OSS's clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 * gate) with the gate clamped
    above and up both ways at 7, and biases on both projections (w13's [experts, 2 * inter],
    gate then up; w2's [experts, hidden]); Llama 4's routing weight scaling each expert's
    input instead of its output (`weights_scale_input`)."""

    activation: int = SILU
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    weights_scale_input: bool = False


PLAIN = ExpertForm()


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr):
    """The activation of float32 gate and up products (ExpertForm)."""
    if ACTIVATION == 1:  # CLAMPED_SWIGLU
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0) + 1.0
        out = gate * tl.sigmoid(gate * 1.702) * up
    else:
        out = gate * tl.sigmoid(gate) * up
    return out


@dataclass(frozen=True)
class MoeLaunch:
    """How the grouped matmuls tile: rows per block (also the padding of each expert's run),
    output columns and reduction depth per step, warps and pipeline stages."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# The launch per range of rows per expert (assignments / experts, what one expert's run
# holds on average), shared by both matmuls, as scripts/moe_sweep.py measured it on the H200
# (bf16, the Qwen3-30B-A3B and Qwen3-Next expert shapes at 1, 16, 128 and 1024 tokens; each
# entry is the sweep's best or within 1% of it for both shapes it covers). Short row blocks
# while each expert gets a few rows (little of a block is padding), taller ones as runs grow
# (each weight tile is read once per 32, 64 or 128 rows rather than per 16). The last entry,
# prefill-sized steps, was the sweep's best for both shapes at 8,192 tokens on an H100 (the
# H200's multiprocessors): 20% and 6% faster than the 64-row blocks. Its bound lies between
# the runs measured: 64 rows per expert (64-row blocks best) and 160 (128-row blocks best).
LAUNCHES: tuple[tuple[float, MoeLaunch], ...] = (
    (1.5, MoeLaunch(block_m=16, block_n=64, block_k=128)),  # decode at small batches
    (10, MoeLaunch(block_m=16, block_n=128, block_k=128)),
    (32, MoeLaunch(block_m=32, block_n=128, block_k=128)),
    (128, MoeLaunch(block_m=64, block_n=128, block_k=64)),
    (float("inf"), MoeLaunch(block_m=128, block_n=128, block_k=64, num_warps=8)),
)


def moe_launch(num_rows: int, num_experts: int) -> MoeLaunch:
    """The launch for `num_rows` assignments (tokens x choices) over `num_experts` experts."""
    per_expert = num_rows / num_experts
    return next(launch for most, launch in LAUNCHES if per_expert <= most)


@triton.jit
def _route_token(
    logits_ptr,
    shared_logits_ptr,
    weights_ptr,
    experts_ptr,
    num_experts,
    routed_scale,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    GATED: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    CACHE: tl.constexpr,
):
    """One token's choices from its logits at `logits_ptr` (and shared gates' at
    `shared_logits_ptr`), stored at `weights_ptr` / `experts_ptr`: `route_kernel`'s rule.
    CACHE is the logits' load modifier (".cg" reads past this multiprocessor's L1, for
    logits other programs of the same launch wrote)."""
    ids = tl.arange(0, EXPERTS_POW2)
    inside = ids < num_experts
    logits = tl.load(logits_ptr + ids, mask=inside, other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(inside, probs / tl.sum(probs, axis=0), -1.0)
    # Each pick is one reduction: a probability's bits (non-negative floats order as their
    # bits do) above the complement of its index (so the first index wins a tie).
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EXPERTS_POW2 - 1 - ids).to(tl.int64)
    slots = tl.arange(0, SLOTS_POW2)
    chosen_weights = tl.zeros((SLOTS_POW2,), dtype=tl.float32)
    chosen_experts = tl.zeros((SLOTS_POW2,), dtype=tl.int32)
    for choice in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        weight = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        # NaN logits may win any pick; the clamp keeps even those rows inside the weights.
        first = tl.minimum(EXPERTS_POW2 - 1 - (best & 0xFFFFFFFF).to(tl.int32), num_experts - 1)
        chosen_weights = tl.where(slots == choice, weight, chosen_weights)
        chosen_experts = tl.where(slots == choice, first, chosen_experts)
        keys = tl.where(keys == best, -1, keys)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    chosen_weights *= routed_scale
    for shared in tl.static_range(NUM_SHARED):
        weight = 1.0
        if GATED:
            weight = tl.sigmoid(tl.load(shared_logits_ptr + shared, cache_modifier=CACHE).to(tl.float32))
        chosen_weights = tl.where(slots == TOP_K + shared, weight, chosen_weights)
        chosen_experts = tl.where(slots == TOP_K + shared, num_experts + shared, chosen_experts)
    width = TOP_K + NUM_SHARED
    tl.store(weights_ptr + slots, chosen_weights.to(weights_ptr.dtype.element_ty), mask=slots < width)
    tl.store(experts_ptr + slots, chosen_experts, mask=slots < width)


@triton.jit
def route_kernel(
    logits_ptr,
    shared_logits_ptr,
    weights_ptr,
    experts_ptr,
    num_experts,
    stride_logits,
    stride_shared,
    routed_scale,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    GATED: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One token's choices: the TOP_K largest of softmax(logits) in float32 (the first index
    wins a tie), renormalised to sum to one if asked, times routed_scale; then NUM_SHARED
    always-on experts (indices num_experts, ...), each weighted by sigmoid(its gate's logit)
    where GATED, else by 1."""
    wait_for_inputs(DEPENDENT)
    token = tl.program_id(0)
    out = token * (TOP_K + NUM_SHARED)
    _route_token(
        logits_ptr + token * stride_logits,
        shared_logits_ptr + token * stride_shared,
        weights_ptr + out,
        experts_ptr + out,
        num_experts,
        routed_scale,
        TOP_K,
        NUM_SHARED,
        GATED,
        EXPERTS_POW2,
        SLOTS_POW2,
        RENORMALIZE,
        "",
    )


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
    shared_logits: torch.Tensor | None = None,
    num_shared: int | None = None,
    routed_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights in `dtype`, int32 experts), each
    [tokens, top_k + num_shared]: the routed choices, then the always-on experts, weighted by
    the sigmoid of their gate logits `shared_logits` [tokens, num_shared] where given, else by
    1; what `SparseMoe.route_reference` computes, in one launch."""
    tokens, num_experts = logits.shape
    if num_shared is None:
        num_shared = 0 if shared_logits is None else shared_logits.shape[1]
    width = top_k + num_shared
    weights = torch.empty((tokens, width), dtype=dtype, device=logits.device)
    experts = torch.empty((tokens, width), dtype=torch.int32, device=logits.device)
    route_kernel[(tokens,)](
        logits,
        shared_logits if shared_logits is not None else logits,
        weights,
        experts,
        num_experts,
        logits.stride(0),
        shared_logits.stride(0) if shared_logits is not None else 0,
        routed_scale,
        TOP_K=top_k,
        NUM_SHARED=num_shared,
        GATED=shared_logits is not None,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        SLOTS_POW2=triton.next_power_of_2(width),
        RENORMALIZE=renormalize,
        **dependent_launch_args(logits.device),
    )
    return weights, experts


@triton.jit
def _gemv_route_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    logits_ptr,
    arrivals_ptr,
    weights_ptr,
    experts_ptr,
    norm_ptr,
    N,
    K,
    stride_w,
    num_experts,
    routed_scale,
    eps,
    HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    GATED: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NORMED: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The router's logits w @ x (+ bias) (NORMED: of RMSNorm(x), `row_dots`) for BLOCK_N rows
    per program, stored in x's dtype (as the router linear rounds them); the last program to
    finish routes the token from all of them (`_route_token`) and sets `arrivals` back to
    zero for the next launch."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    dots, _ = row_dots(
        x_ptr, w_ptr, rows, in_rows, K, stride_w, 0, norm_ptr, eps, False, NORMED, DEPENDENT, BLOCK_N, BLOCK_K
    )
    if HAS_BIAS:
        dots += tl.load(bias_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(logits_ptr + rows, dots.to(logits_ptr.dtype.element_ty), mask=in_rows)
    # Every thread's stores, then one release: the program that arrives last acquires them all.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        _route_token(
            logits_ptr,
            logits_ptr + num_experts,
            weights_ptr,
            experts_ptr,
            num_experts,
            routed_scale,
            TOP_K,
            NUM_SHARED,
            GATED,
            EXPERTS_POW2,
            SLOTS_POW2,
            RENORMALIZE,
            ".cg",
        )
        tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="gpu")


_tuned_gemv_route_kernel = triton.autotune(configs=MATVEC_CONFIGS, key=["N", "K", "NORMED"])(_gemv_route_kernel)

# One arrival counter per device, zero between launches (each launch's last program resets
# it). Launches on one device run one after another in stream order, which all of Kestrel's
# forward passes do; two streams routing at once on one device would share it.
_arrivals: dict[torch.device, torch.Tensor] = {}


def _arrival_counter(device: torch.device) -> torch.Tensor:
    counter = _arrivals.get(device)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Made inside a capture, its zeroing would run at replay only, not before.
            raise RuntimeError("gemv_route's first call must come before graph capture (a warm-up forward)")
        counter = _arrivals[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def gemv_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    num_gated_shared: int = 0,
    config: triton.Config | None = None,
    norm: RowNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of one token's router logits x [1, K] (or norm(x)) @ weight[N, K].T (+ bias), in one launch
    (the router's matvec and the routing cost one launch, where they cost two): weights in x's
    dtype and int32 experts, [1, top_k + num_gated_shared]. The rows past `num_experts` are
    the gates of always-on experts (Qwen3-Next's shared expert), each weighted by its sigmoid.
    The launch configuration is the matvec's, autotuned per shape unless given (tests)."""
    rows, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1 or rows != num_experts + num_gated_shared:
        raise ValueError(
            f"gemv_route takes x [1, {k}] and a row-major weight of {num_experts} + {num_gated_shared} rows; "
            f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    width = top_k + num_gated_shared
    logits = torch.empty(rows, dtype=x.dtype, device=x.device)
    weights = torch.empty((1, width), dtype=x.dtype, device=x.device)
    experts = torch.empty((1, width), dtype=torch.int32, device=x.device)
    args = (x.contiguous(), weight, logits if bias is None else bias, logits, _arrival_counter(x.device))
    args += (weights, experts, logits if norm is None else norm.weight, rows, k, weight.stride(0), num_experts, 1.0)
    args += (0.0 if norm is None else norm.eps,)
    constants = dict(
        HAS_BIAS=bias is not None,
        TOP_K=top_k,
        NUM_SHARED=num_gated_shared,
        GATED=num_gated_shared > 0,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        SLOTS_POW2=triton.next_power_of_2(width),
        RENORMALIZE=renormalize,
        NORMED=norm is not None,
    )
    launch_rows(_gemv_route_kernel, _tuned_gemv_route_kernel, rows, config, args, **constants)
    return weights, experts


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("num_rows",))
def grouped_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    row_ids_ptr,
    block_experts_ptr,
    weights_ptr,
    scales_ptr,
    bias_ptr,
    num_rows,
    n,
    k,
    stride_a,
    stride_b_expert,
    stride_b_n,
    stride_c,
    stride_scales,
    stride_bias,
    A_ROW_DIVISOR: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_INPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """C[row] = A[row // A_ROW_DIVISOR] @ B[expert]^T for the block's rows (B is [n, k] per
    expert, as a linear layer's weight), optionally times weights[row]. With SILU_AND_MUL, B
    holds 2n rows (gate, then up) and C[row] = silu(gate) * up, from float32 accumulators, so
    the gate and up products never go to memory (ACTIVATION: `_activate`'s). With HAS_SCALE,
    B is float8 with a scale per (expert, row): its tiles are widened to A's dtype in registers
    and each product column multiplied by its row's scale. HAS_BIAS adds bias[expert, column]
    (the up columns' n further on) before the activation and any weight. WEIGHT_INPUT
    multiplies the products by weights[row] as if A's row had been scaled (Llama 4)."""
    wait_for_inputs(DEPENDENT)
    # A row block's column blocks run side by side, so its gathered rows come from memory
    # once and from L2 after; an expert's weights stay in L2 across its few row blocks.
    column_blocks = tl.cdiv(n, BLOCK_N)
    block = tl.program_id(0) // column_blocks
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last expert's run: the grid covers the most blocks routing can need
        return
    rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows  # padding rows hold num_rows
    offs_n = (tl.program_id(0) % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (rows // A_ROW_DIVISOR)[:, None] * stride_a
    b_cols = b_ptr + expert.to(tl.int64) * stride_b_expert + offs_n[None, :] * stride_b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        in_k = start + offs_k < k
        a = tl.load(a_rows + (start + offs_k)[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
        b_mask = in_k[:, None] & (offs_n < n)[None, :]
        b = tl.load(b_cols + (start + offs_k)[:, None], mask=b_mask, other=0.0).to(a.dtype)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if SILU_AND_MUL:
            b_up = tl.load(b_cols + n * stride_b_n + (start + offs_k)[:, None], mask=b_mask, other=0.0)
            up += tl.dot(a, b_up.to(a.dtype), input_precision=PRECISION)
    if HAS_SCALE:
        row_scales = scales_ptr + expert.to(tl.int64) * stride_scales + offs_n
        acc *= tl.load(row_scales, mask=offs_n < n, other=0.0)[None, :]
        if SILU_AND_MUL:
            up *= tl.load(row_scales + n, mask=offs_n < n, other=0.0)[None, :]
    if WEIGHT_INPUT:
        row_weights = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
        acc *= row_weights
        if SILU_AND_MUL:
            up *= row_weights
    if HAS_BIAS:
        row_bias = bias_ptr + expert.to(tl.int64) * stride_bias + offs_n
        acc += tl.load(row_bias, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
        if SILU_AND_MUL:
            up += tl.load(row_bias + n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
    if SILU_AND_MUL:
        acc = _activate(acc, up, ACTIVATION)
    if SCALE_BY_WEIGHT:
        acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + rows[:, None] * stride_c + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n < n)[None, :],
    )


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("num_rows",))
def count_rows_kernel(experts_ptr, counts_ptr, num_rows, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    """counts[e] += the assignments to expert e among this program's rows."""
    wait_for_inputs(DEPENDENT)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num_rows
    chosen = tl.load(experts_ptr + offs, mask=inside, other=0)
    tl.atomic_add(counts_ptr + chosen, 1, mask=inside)


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("num_rows", "capacity"))
def expert_runs_kernel(
    counts_ptr,
    cursors_ptr,
    row_ids_ptr,
    block_experts_ptr,
    num_rows,
    capacity,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One program per expert: where its run starts (the padded counts before it, summed; the
    cursor `place_rows_kernel` advances), the expert of each of its blocks, and padding rows
    after its assignments. The last expert's program also marks what lies past the last run."""
    wait_for_inputs(DEPENDENT)
    expert = tl.program_id(0)
    ids = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + ids, mask=ids < NUM_EXPERTS, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(ids < expert, padded, 0))
    end = start + tl.sum(tl.where(ids == expert, padded, 0))
    tl.store(cursors_ptr + expert, start)
    _fill(row_ids_ptr, start + tl.sum(tl.where(ids == expert, counts, 0)), end, num_rows, CHUNK)
    _fill(block_experts_ptr, start // BLOCK_M, end // BLOCK_M, expert, CHUNK)
    if expert == NUM_EXPERTS - 1:
        total = tl.sum(padded)
        _fill(row_ids_ptr, total, capacity, num_rows, CHUNK)
        _fill(block_experts_ptr, total // BLOCK_M, capacity // BLOCK_M, -1, CHUNK)


@triton.jit
def _fill(ptr, begin, end, value, CHUNK: tl.constexpr):
    """ptr[begin:end] = value."""
    for first in range(begin, end, CHUNK):
        offs = first + tl.arange(0, CHUNK)
        tl.store(ptr + offs, tl.full((CHUNK,), value, tl.int32), mask=offs < end)


# Values that change from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("num_rows",))
def place_rows_kernel(experts_ptr, cursors_ptr, row_ids_ptr, num_rows, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    """Each assignment takes the next free place in its expert's run. The order inside a run
    is whatever the atomics give: every row is computed alone, so it does not matter."""
    wait_for_inputs(DEPENDENT)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num_rows
    chosen = tl.load(experts_ptr + offs, mask=inside, other=0)
    place = tl.atomic_add(cursors_ptr + chosen, 1, mask=inside)
    tl.store(row_ids_ptr + place, offs, mask=inside)


def group_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Rows the grouped layout can need: every assignment, plus up to block_m - 1 padding
    rows for each expert that got any (at most min(num_experts, num_rows) of them)."""
    capacity = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-capacity // block_m) * block_m


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments [tokens, top_k] -> (row ids grouped by expert, each run padded to whole
    blocks with padding rows = tokens * top_k; the expert of each block, -1 past the end)."""
    flat = experts.flatten().to(torch.int32)
    num_rows = flat.numel()
    capacity = group_capacity(num_rows, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    cursors = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    row_ids = torch.empty(capacity, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
    rows_per_program = 256
    row_grid = (triton.cdiv(num_rows, rows_per_program),)
    count_rows_kernel[row_grid](flat, counts, num_rows, BLOCK=rows_per_program, **dependent_launch_args(flat.device))
    expert_runs_kernel[(num_experts,)](
        counts,
        cursors,
        row_ids,
        block_experts,
        num_rows,
        capacity,
        NUM_EXPERTS=num_experts,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        CHUNK=64,
        **dependent_launch_args(flat.device),
    )
    place_rows_kernel[row_grid](
        flat, cursors, row_ids, num_rows, BLOCK=rows_per_program, **dependent_launch_args(flat.device)
    )
    return row_ids, block_experts


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `group_by_expert`: the same layout, each run in token order."""
    flat = experts.flatten()
    num_rows = flat.numel()
    capacity = group_capacity(num_rows, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_rows, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    destination = (padded_ends - padded_counts)[sorted_experts] + rank
    row_ids = torch.full((capacity,), num_rows, dtype=torch.long, device=flat.device)
    row_ids[destination] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return row_ids, block_experts


@functools.cache
def _shared_memory_bytes(device: torch.device) -> int:
    """Shared memory one block may use (227 KB on Hopper); unbounded off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1 << 40
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 232448)


def stages_that_fit(launch: MoeLaunch, element_size: int, weight_tiles: int, shared_memory: int) -> int:
    """The launch's pipeline stages, fewer where the tiles they buffer would overflow shared
    memory: the table was sized for bf16 and one weight tile, and a float32 model or the
    gate-and-up matmul (two weight tiles) needs more. Triton buffers stages - 1 copies."""
    per_stage = (launch.block_m + weight_tiles * launch.block_n) * launch.block_k * element_size
    stages = launch.num_stages
    while stages > 2 and (stages - 1) * per_stage > shared_memory:
        stages -= 1
    return stages


def _grouped_matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    row_ids: torch.Tensor | None,
    block_experts: torch.Tensor,
    num_rows: int,
    a_row_divisor: int,
    launch: MoeLaunch,
    routing_weights: torch.Tensor | None = None,
    silu_and_mul: bool = False,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: int = SILU,
    weight_input: bool = False,
) -> torch.Tensor:
    """One launch over every block (`row_ids`: each block's rows, padded with num_rows).
    `silu_and_mul`: the weight's rows are gate then up, and the output is their activation.
    `scales` [experts, rows]: the weight is float8, each row times its scale. `bias`
    [experts, rows]: added to the products. `routing_weights` [rows] scale the output, or
    with `weight_input` the products before bias and activation."""
    n, k = weight.shape[1] // (2 if silu_and_mul else 1), weight.shape[2]
    out = torch.empty((num_rows, n), dtype=a.dtype, device=a.device)
    grid = (block_experts.numel() * triton.cdiv(n, launch.block_n),)
    grouped_matmul_kernel[grid](
        a,
        weight,
        out,
        row_ids,
        block_experts,
        routing_weights if routing_weights is not None else out,
        scales if scales is not None else out,
        bias if bias is not None else out,
        num_rows,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        0 if scales is None else scales.stride(0),
        0 if bias is None else bias.stride(0),
        A_ROW_DIVISOR=a_row_divisor,
        HAS_SCALE=scales is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        WEIGHT_INPUT=routing_weights is not None and weight_input,
        SCALE_BY_WEIGHT=routing_weights is not None and not weight_input,
        SILU_AND_MUL=silu_and_mul,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        # float32 models get exact float32 products (their outputs are compared with HF's).
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps,
        num_stages=stages_that_fit(launch, a.element_size(), 1 + silu_and_mul, _shared_memory_bytes(a.device)),
        **dependent_launch_args(a.device),
    )
    return out


@triton.jit
def _expert_gate_up_kernel(
    x_ptr,
    w13_ptr,
    scales_ptr,
    bias_ptr,
    weights_ptr,
    experts_ptr,
    out_ptr,
    norm_ptr,
    inter,
    K,
    stride_x,
    stride_w_expert,
    stride_w_n,
    stride_scales,
    stride_bias,
    eps,
    WIDTH: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_INPUT: tl.constexpr,
    NORMED: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row, n] = the activation of gate[n] and up[n] of routed row `row` (token row //
    WIDTH) through its expert's gate rows w13[e, :inter] and up rows w13[e, inter:], float32
    throughout; with HAS_SCALE, float8 rows, each dot times its row's scale; HAS_BIAS and
    WEIGHT_INPUT as `grouped_matmul_kernel`'s; NORMED, of the token's RMSNorm (`row_dots`)."""
    row = tl.program_id(0)
    # The expert comes from the routing kernel just before: nothing to prefetch. Released only
    # after the wait, so that the down matvec after this one may read the experts early.
    wait_then_release(DEPENDENT)
    expert = tl.load(experts_ptr + row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < inter
    x_row = x_ptr + (row // WIDTH) * stride_x
    w_rows = w13_ptr + expert * stride_w_expert
    gate, up = row_dots(
        x_row, w_rows, cols, in_cols, K, stride_w_n, inter, norm_ptr, eps, True, NORMED, False, BLOCK_N, BLOCK_K
    )
    if HAS_SCALE:
        row_scales = scales_ptr + expert * stride_scales + cols
        gate *= tl.load(row_scales, mask=in_cols, other=0.0)
        up *= tl.load(row_scales + inter, mask=in_cols, other=0.0)
    if WEIGHT_INPUT:
        weight = tl.load(weights_ptr + row).to(tl.float32)
        gate *= weight
        up *= weight
    if HAS_BIAS:
        row_bias = bias_ptr + expert * stride_bias + cols
        gate += tl.load(row_bias, mask=in_cols, other=0.0).to(tl.float32)
        up += tl.load(row_bias + inter, mask=in_cols, other=0.0).to(tl.float32)
    activated = _activate(gate, up, ACTIVATION)
    tl.store(out_ptr + row * inter + cols, activated.to(out_ptr.dtype.element_ty), mask=in_cols)


@triton.jit
def _expert_down_sum_kernel(
    activated_ptr,
    w2_ptr,
    scales_ptr,
    bias_ptr,
    experts_ptr,
    weights_ptr,
    out_ptr,
    residual_ptr,
    hidden,
    inter,
    stride_w_expert,
    stride_w_n,
    stride_out,
    stride_scales,
    stride_bias,
    stride_residual,
    WIDTH: tl.constexpr,
    CHOICES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[token, n] = sum over the token's WIDTH routed rows of weight * (w2[e, n] .
    activated[row] + bias[e, n]), summed in float32 and rounded once; unWEIGHTED (the weights
    scaled the input), a plain sum; HAS_RESIDUAL, plus the token's residual row
    (`add_residual`). All of a token's choices share one tile [CHOICES, BLOCK_N, BLOCK_K]
    (CHOICES: WIDTH rounded up to a power of two), so every expert's rows are loaded
    together: 7% faster per Qwen3-30B-A3B layer than one expert after another (H100).

    Launched as dependent of the gate/up matvec, which lets it start only once every kernel
    before that one has finished (`wait_then_release`): the experts are read, and the first
    block of their weights requested, while the gate/up matvec still runs (3% off a
    Qwen3-30B-A3B decode step at one request, H100). Read past L1 (".cg"): the experts'
    buffer may have held another step's before."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < hidden
    choices = tl.arange(0, CHOICES)
    in_choices = choices < WIDTH
    rows = token * WIDTH + choices
    experts = tl.load(experts_ptr + rows, mask=in_choices, other=0, cache_modifier=".cg").to(tl.int64)
    w_rows = w2_ptr + experts[:, None, None] * stride_w_expert + cols[None, :, None] * stride_w_n
    inputs = activated_ptr + rows[:, None] * inter
    row_mask = in_choices[:, None, None] & in_cols[None, :, None]
    k = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + k[None, None, :], mask=row_mask & (k < inter)[None, None, :], other=0.0)
    wait_for_inputs(DEPENDENT)
    dots = tl.zeros((CHOICES, BLOCK_N), dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        block = start + k
        x = tl.load(inputs + block[None, :], mask=in_choices[:, None] & (block < inter)[None, :], other=0.0)
        dots += tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None, :], axis=2)
        following = block + BLOCK_K
        w = tl.load(w_rows + following[None, None, :], mask=row_mask & (following < inter)[None, None, :], other=0.0)
    both = in_choices[:, None] & in_cols[None, :]
    if HAS_SCALE:
        dots *= tl.load(scales_ptr + experts[:, None] * stride_scales + cols[None, :], mask=both, other=0.0)
    if HAS_BIAS:
        dots += tl.load(bias_ptr + experts[:, None] * stride_bias + cols[None, :], mask=both, other=0.0).to(tl.float32)
    if WEIGHTED:
        dots *= tl.load(weights_ptr + rows, mask=in_choices, other=0.0).to(tl.float32)[:, None]
    total = tl.sum(dots, axis=0)
    out = total.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        out = add_residual(total, residual_ptr + token * stride_residual, cols, in_cols, out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out + cols, out, mask=in_cols)


@dataclass(frozen=True)
class MatvecLaunch:
    """How the expert matvecs tile: output rows per program, and the columns read per load."""

    block_n: int
    block_k: int
    num_warps: int = 4


def matvec_launches(inter: int, hidden: int, element_size: int = 2) -> tuple[MatvecLaunch, MatvecLaunch]:
    """Gate/up: two output rows per program, each read in blocks of up to 2048 columns (many
    loads in flight per multiprocessor, as the dense one-row matvec's best launches). Down:
    two output rows of every choice per program, 256 columns a load. Within 2% of the best
    of `scripts/moe_sweep.py`'s candidates at 1 and 2 tokens for both Qwen3 MoE shapes (H100).
    Float8 experts (`element_size` 1) take twice the gate/up rows a program, so that a program
    moves the bytes of bf16's launch: Qwen3-30B-A3B `--quantization fp8` at one request 2.29
    and 2.33 ms against 2.35-2.38 (H100). Widening the down matvec's loads as well was slower
    (2.46-2.47 ms), and is not done."""
    widen = max(1, 2 // element_size)
    gate_up = MatvecLaunch(block_n=2 * widen, block_k=min(2048, triton.next_power_of_2(hidden)), num_warps=4)
    down = MatvecLaunch(block_n=2, block_k=min(256, triton.next_power_of_2(inter)), num_warps=4)
    return gate_up, down


def expert_matvecs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    launches: tuple[MatvecLaunch, MatvecLaunch] | None = None,
    scales: ExpertScales = (None, None),
    form: ExpertForm = PLAIN,
    norm: RowNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_moe` for rows that share no expert: one matrix-vector product per routed row,
    in two launches (gate/up with its activation, then down summed over each token's
    experts). With `norm`, of each token's norm(hidden), which the gate/up programs compute
    as they read it; with `residual` [tokens, h], plus that, added by the down matvec."""
    tokens, width = experts.shape
    s13, s2 = scales
    b13, b2 = form.w13_bias, form.w2_bias
    inter, hidden_size = w2.shape[2], w2.shape[1]
    gate_up, down = launches or matvec_launches(inter, hidden_size, w13.element_size())
    activated = torch.empty((tokens * width, inter), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    pdl = dependent_launch_args(hidden.device)
    _expert_gate_up_kernel[(tokens * width, triton.cdiv(inter, gate_up.block_n))](
        hidden,
        w13,
        w13 if s13 is None else s13,
        w13 if b13 is None else b13,
        weights,
        experts,
        activated,
        activated if norm is None else norm.weight,
        inter,
        hidden_size,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        0 if s13 is None else s13.stride(0),
        0 if b13 is None else b13.stride(0),
        0.0 if norm is None else norm.eps,
        WIDTH=width,
        HAS_SCALE=s13 is not None,
        HAS_BIAS=b13 is not None,
        ACTIVATION=form.activation,
        WEIGHT_INPUT=form.weights_scale_input,
        NORMED=norm is not None,
        BLOCK_N=gate_up.block_n,
        BLOCK_K=gate_up.block_k,
        num_warps=gate_up.num_warps,
        **pdl,
    )
    _expert_down_sum_kernel[(tokens, triton.cdiv(hidden_size, down.block_n))](
        activated,
        w2,
        w2 if s2 is None else s2,
        w2 if b2 is None else b2,
        experts,
        weights,
        out,
        out if residual is None else residual,
        hidden_size,
        inter,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        0 if s2 is None else s2.stride(0),
        0 if b2 is None else b2.stride(0),
        0 if residual is None else residual.stride(0),
        WIDTH=width,
        HAS_SCALE=s2 is not None,
        HAS_BIAS=b2 is not None,
        WEIGHTED=not form.weights_scale_input,
        HAS_RESIDUAL=residual is not None,
        CHOICES=triton.next_power_of_2(width),
        BLOCK_N=down.block_n,
        BLOCK_K=down.block_k,
        num_warps=down.num_warps,
        **pdl,
    )
    return out


def expected_repeats(num_rows: int, num_experts: int) -> float:
    """How many pairs of rows routed at random pick the same expert: the weight reads that
    one-row blocks repeat where grouping would share them."""
    return num_rows * (num_rows - 1) / (2 * num_experts)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    launch: MoeLaunch | None = None,
    scales: ExpertScales = (None, None),
    form: ExpertForm = PLAIN,
    norm: RowNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [tokens, h]; w13 [experts, 2 * inter, h] (gate then up); w2 [experts, h, inter];
    weights, experts [tokens, top_k]. Returns sum over choices of weight * expert(hidden).
    `scales`: w13's and w2's per-row scales where they are float8 (else None); `form`: what
    the family's experts compute otherwise (biases, activation, weighted inputs). With
    `norm`, of norm(hidden); with `residual` [tokens, h], plus that: inside the kernels where
    the rows take the expert matvecs, else in launches of their own."""
    tokens, top_k = experts.shape
    num_rows = tokens * top_k
    num_experts = w13.shape[0]
    launch = launch or moe_launch(num_rows, num_experts)
    flat_weights = weights.flatten().contiguous()
    if expected_repeats(num_rows, num_experts) < 1:
        experts = experts.contiguous()
        matvecs_of = dict(scales=scales, form=form, norm=norm, residual=residual)
        return expert_matvecs(hidden, w13, w2, flat_weights, experts, **matvecs_of)
    if norm is not None:
        hidden = rms_norm(hidden, norm.weight, norm.eps)
    out = _grouped_experts(hidden, w13, w2, flat_weights, experts, launch, scales, form)
    return out if residual is None else out + residual


def _grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    flat_weights: torch.Tensor,
    experts: torch.Tensor,
    launch: MoeLaunch,
    scales: ExpertScales,
    form: ExpertForm,
) -> torch.Tensor:
    """`fused_moe` through grouped matmuls: each expert's rows sorted into blocks."""
    tokens, top_k = experts.shape
    num_rows = tokens * top_k
    num_experts = w13.shape[0]
    s13, s2 = scales
    row_ids, block_experts = group_by_expert(experts, num_experts, launch.block_m)
    scale_input = form.weights_scale_input
    activated = _grouped_matmul(
        hidden,
        w13,
        row_ids,
        block_experts,
        num_rows,
        top_k,
        launch,
        flat_weights if scale_input else None,
        silu_and_mul=True,
        scales=s13,
        bias=form.w13_bias,
        activation=form.activation,
        weight_input=scale_input,
    )
    down = _grouped_matmul(
        activated,
        w2,
        row_ids,
        block_experts,
        num_rows,
        1,
        launch,
        None if scale_input else flat_weights,
        scales=s2,
        bias=form.w2_bias,
    )
    return down.view(tokens, top_k, -1).sum(dim=1)
