"""Fused Triton kernels for the elementwise work between matmuls: RMSNorm (with the residual
add), rotary embedding, both at once on the query and key heads (Qwen3's per-head norms),
and SiLU-and-multiply.

Each rounds to the activation dtype at the same points as the torch path (and Hugging
Face), so outputs agree bit for bit in float32 and to the last bf16 ulp otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs

if TYPE_CHECKING:
    from kestrel.layers.ops import LatentKey


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x_row,
    stride_x_head,
    stride_r_row,
    stride_o_row,
    stride_o_head,
    stride_ro_row,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    DEPENDENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    in_row = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)  # no kernel writes it
    wait_for_inputs(DEPENDENT)
    x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r_row + cols, mask=in_row, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro_row + cols, x, mask=in_row)
    x32 = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / num_cols + eps)
    normed = (x32 * inverse_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o_row + head * stride_o_head + cols,
        (weight * normed).to(out_ptr.dtype.element_ty),
        mask=in_row,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x [rows, dim] or [rows, heads, dim].

    With `residual` (2-D only): returns (norm(x + residual), x + residual).
    """
    dim = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    head_stride = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_head_stride = out.stride(1) if x.dim() == 3 else 0
    residual_out = torch.empty_like(x) if residual is not None else out
    source = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0], heads)](
        x,
        source,
        weight,
        out,
        residual_out,
        x.stride(0),
        head_stride,
        source.stride(0),
        out.stride(0),
        out_head_stride,
        residual_out.stride(0),
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(dim),
        **dependent_launch_args(x.device),
    )
    return (out, residual_out) if residual is not None else out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr
):
    wait_for_inputs(DEPENDENT)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=inside, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * width] holding gate then up."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block, **dependent_launch_args(gate_up.device)
    )
    return out


@triton.jit
def rotate_half_pair(first, second, cos_row_ptr, sin_row_ptr, cols, mask, HALF: tl.constexpr):
    """The columns `cols` of a head's two halves, rotated by one row of cos and sin:
    x * cos + rotate_half(x) * sin, rounding each product and the sum as torch does."""
    dtype = first.dtype
    cos_first = tl.load(cos_row_ptr + cols, mask=mask, other=0.0)
    cos_second = tl.load(cos_row_ptr + HALF + cols, mask=mask, other=0.0)
    sin_first = tl.load(sin_row_ptr + cols, mask=mask, other=0.0)
    sin_second = tl.load(sin_row_ptr + HALF + cols, mask=mask, other=0.0)
    new_first = (first * cos_first).to(dtype) + (-second * sin_first).to(dtype)
    new_second = (second * cos_second).to(dtype) + (first * sin_second).to(dtype)
    return new_first.to(dtype), new_second.to(dtype)


@triton.jit
def _head_block(
    x_ptr, stride_x_token, stride_x_head, num_heads, HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr
):
    """This program's token, its HEADS heads, and where the first half of each lies (the
    second is HALF further): one program per token and HEADS of its heads."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    inside = cols < HALF
    mask = (heads < num_heads)[:, None] & inside[None, :]
    base = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + cols[None, :]
    return token, heads, cols, inside, mask, base


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_token,
    stride_x_head,
    stride_cos,
    num_heads,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One program per token and HEADS of its heads, which share the token's cos and sin."""
    wait_for_inputs(DEPENDENT)
    token, heads, cols, inside, mask, base = _head_block(
        x_ptr, stride_x_token, stride_x_head, num_heads, HALF, BLOCK, HEADS
    )
    first = tl.load(base, mask=mask, other=0.0)
    second = tl.load(base + HALF, mask=mask, other=0.0)
    cos_row, sin_row = cos_ptr + token * stride_cos, sin_ptr + token * stride_cos
    first, second = rotate_half_pair(first, second, cos_row, sin_row, cols, inside, HALF)
    tl.store(base, first, mask=mask)
    tl.store(base + HALF, second, mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(
    x_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_token,
    stride_x_head,
    stride_cos,
    num_q_heads,
    num_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """In place, HEADS of one token's query-then-key heads: each RMS-normalised over its
    head_dim with the query's or the key's weight, rounded as `_rms_norm_kernel` rounds, then
    rotated as `_rotary_kernel` rotates."""
    wait_for_inputs(DEPENDENT)
    token, heads, cols, inside, mask, base = _head_block(
        x_ptr, stride_x_token, stride_x_head, num_heads, HALF, BLOCK, HEADS
    )
    first = tl.load(base, mask=mask, other=0.0)
    second = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = first.dtype
    first32, second32 = first.to(tl.float32), second.to(tl.float32)
    squares = tl.sum(first32 * first32, 1) + tl.sum(second32 * second32, 1)
    inverse_rms = (1.0 / tl.sqrt(squares / (2 * HALF) + eps))[:, None]
    is_query = (heads < num_q_heads)[:, None]
    weight_first = tl.where(
        is_query,
        tl.load(q_weight_ptr + cols, mask=inside, other=0.0)[None, :],
        tl.load(k_weight_ptr + cols, mask=inside, other=0.0)[None, :],
    ).to(tl.float32)
    weight_second = tl.where(
        is_query,
        tl.load(q_weight_ptr + HALF + cols, mask=inside, other=0.0)[None, :],
        tl.load(k_weight_ptr + HALF + cols, mask=inside, other=0.0)[None, :],
    ).to(tl.float32)
    first = (weight_first * (first32 * inverse_rms).to(dtype).to(tl.float32)).to(dtype)
    second = (weight_second * (second32 * inverse_rms).to(dtype).to(tl.float32)).to(dtype)
    cos_row, sin_row = cos_ptr + token * stride_cos, sin_ptr + token * stride_cos
    first, second = rotate_half_pair(first, second, cos_row, sin_row, cols, inside, HALF)
    tl.store(base, first, mask=mask)
    tl.store(base + HALF, second, mask=mask)


def qk_norm_rotary_(
    heads: torch.Tensor,
    num_q_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """heads [tokens, query heads + key heads, head_dim] (a qkv projection's first columns),
    each normalised by its weight and rotated (full rotary dim), in place: one launch where
    two norms and two rotary passes took four."""
    tokens, num_heads, head_dim = heads.shape
    if tokens:
        half = head_dim // 2
        per_program = min(ROTARY_HEADS, triton.next_power_of_2(num_heads))
        _qk_norm_rotary_kernel[(tokens, triton.cdiv(num_heads, per_program))](
            heads,
            q_weight,
            k_weight,
            cos,
            sin,
            heads.stride(0),
            heads.stride(1),
            cos.stride(0),
            num_q_heads,
            num_heads,
            eps,
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            HEADS=per_program,
            **dependent_launch_args(heads.device),
        )
    return heads


# Heads one rotary program takes: a program per (token, head) moved 256 bytes of a
# 128-wide head, and a prefill of 8,000 tokens launched 320,000 of them per layer.
ROTARY_HEADS = 16


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place (rotate-half layout, full rotary dim)."""
    tokens, heads, head_dim = x.shape
    if tokens:
        half = head_dim // 2
        per_program = min(ROTARY_HEADS, triton.next_power_of_2(heads))
        _rotary_kernel[(tokens, triton.cdiv(heads, per_program))](
            x,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            heads,
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            HEADS=per_program,
            **dependent_launch_args(x.device),
        )
    return x


@triton.jit
def _head_norm_rotary_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_token,
    stride_x_head,
    stride_cos,
    num_heads,
    head_dim,
    eps,
    HALF_ROTARY: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """HEADS heads of one token: RMS-normalised over head_dim (rounded as `_rms_norm_kernel`
    rounds), then the first 2 * HALF_ROTARY columns rotated as `rotate_half_pair` rotates;
    written to a contiguous `out`. Each column's rotation partner is read as a second load."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    inside = cols < head_dim
    rotated = cols < 2 * HALF_ROTARY
    partner = tl.where(cols < HALF_ROTARY, cols + HALF_ROTARY, cols - HALF_ROTARY)
    partner = tl.where(rotated, partner, cols)
    mask = (heads < num_heads)[:, None] & inside[None, :]
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)[None, :]
    partner_weight = tl.load(weight_ptr + partner, mask=inside, other=0.0).to(tl.float32)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + cols, mask=rotated, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * stride_cos + cols, mask=rotated, other=0.0)[None, :]
    wait_for_inputs(DEPENDENT)
    rows = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
    x = tl.load(rows + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    inverse_rms = (1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / head_dim + eps))[:, None]
    normed = (weight * (x32 * inverse_rms).to(dtype).to(tl.float32)).to(dtype)
    other = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    other = (partner_weight * (other * inverse_rms).to(dtype).to(tl.float32)).to(dtype)
    signed_other = tl.where((cols < HALF_ROTARY)[None, :], -other, other)
    turned = ((normed * cos.to(dtype)).to(dtype) + (signed_other * sin.to(dtype)).to(dtype)).to(dtype)
    result = tl.where(rotated[None, :], turned, normed)
    out_rows = out_ptr + token * num_heads * head_dim + heads[:, None] * head_dim
    tl.store(out_rows + cols[None, :], result, mask=mask)


def head_norm_rotary(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """x [tokens, heads, head_dim] (any token and head strides) normalised per head by
    `weight`, then rotated on its first cos.shape[-1] columns (partial rotary): a new
    contiguous tensor, in one launch where a copy, a norm and a partial rotary took a dozen."""
    tokens, num_heads, head_dim = x.shape
    out = torch.empty((tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        per_program = min(ROTARY_HEADS, triton.next_power_of_2(num_heads))
        _head_norm_rotary_kernel[(tokens, triton.cdiv(num_heads, per_program))](
            x,
            weight,
            out,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            num_heads,
            head_dim,
            eps,
            HALF_ROTARY=cos.shape[-1] // 2,
            BLOCK=triton.next_power_of_2(head_dim),
            HEADS=per_program,
            **dependent_launch_args(x.device),
        )
    return out


@triton.jit
def _latent_key_kernel(
    kv_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_kv,
    stride_cos,
    latent,
    eps,
    HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One token's latent key: its first `latent` columns normalised (rounded as
    `_rms_norm_kernel` rounds), the 2 * HALF after them rotated as `rotate_half_pair` rotates."""
    token = tl.program_id(0)
    wait_for_inputs(DEPENDENT)
    _latent_key_row(
        kv_ptr + token * stride_kv,
        weight_ptr,
        cos_ptr + token * stride_cos,
        sin_ptr + token * stride_cos,
        out_ptr + token * (latent + 2 * HALF),
        latent,
        eps,
        HALF,
        BLOCK_LATENT,
        BLOCK_HALF,
    )


@triton.jit
def _latent_key_row(
    row,
    weight_ptr,
    cos_row,
    sin_row,
    out_row,
    latent,
    eps,
    HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_LATENT)
    inside = cols < latent
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    x = tl.load(row + cols, mask=inside, other=0.0)
    x32 = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / latent + eps)
    normed = (x32 * inverse_rms).to(x.dtype).to(tl.float32)
    tl.store(out_row + cols, (weight * normed).to(out_row.dtype.element_ty), mask=inside)
    pair = tl.arange(0, BLOCK_HALF)
    in_half = pair < HALF
    first = tl.load(row + latent + pair, mask=in_half, other=0.0)
    second = tl.load(row + latent + HALF + pair, mask=in_half, other=0.0)
    first, second = rotate_half_pair(first, second, cos_row, sin_row, pair, in_half, HALF)
    tl.store(out_row + latent + pair, first, mask=in_half)
    tl.store(out_row + latent + HALF + pair, second, mask=in_half)


def latent_key(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """`ops.latent_key` in one launch: kv [tokens, latent + rope] -> [tokens, 1, latent + rope]."""
    tokens, width = kv.shape
    rope = cos.shape[-1]
    out = torch.empty((tokens, 1, width), dtype=kv.dtype, device=kv.device)
    if tokens:
        _latent_key_kernel[(tokens,)](
            kv,
            weight,
            cos,
            sin,
            out,
            kv.stride(0),
            cos.stride(0),
            width - rope,
            eps,
            HALF=rope // 2,
            BLOCK_LATENT=triton.next_power_of_2(width - rope),
            BLOCK_HALF=triton.next_power_of_2(rope // 2),
            **dependent_launch_args(kv.device),
        )
    return out


# Latent attention's per-head projections at a decode step's few rows: the kernels below
# read each head's weight once for all the step's rows (a batched matmul per step, and the
# copies, rotary pass and concatenation around it, took several launches a layer).
# Latent columns per program absorbing, value dims per program projecting up: tiles of 4,096
# weights, so that DeepSeek-V2-Lite's 16 heads still make a few hundred programs.
ABSORB_BLOCK, VALUES_BLOCK = 32, 8


# The row count changes from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("tokens",))
def _absorb_query_kernel(
    query_ptr,
    key_up_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    kv_ptr,
    norm_weight_ptr,
    key_out_ptr,
    tokens,
    stride_q_token,
    stride_q_head,
    stride_w_head,
    stride_w_row,
    stride_cos,
    stride_kv,
    num_heads,
    nope,
    latent,
    eps,
    HALF: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    WITH_KEY: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """Program (head, block): for every row, the head's nope query times its key
    up-projection's columns of this latent block, in float32, rounded once; the program past
    the last block rotates the head's rope part (as `rotate_half_pair` does) instead, and
    head 0's also makes each row's latent key (WITH_KEY, as `_latent_key_kernel` does)."""
    head, block = tl.program_id(0), tl.program_id(1)
    width = latent + 2 * HALF
    out_head = out_ptr + head * width
    if block * BLOCK_L >= latent:
        wait_for_inputs(DEPENDENT)
        pair = tl.arange(0, BLOCK_HALF)
        in_half = pair < HALF
        for token in range(tokens):
            rope = query_ptr + token * stride_q_token + head * stride_q_head + nope
            first = tl.load(rope + pair, mask=in_half, other=0.0)
            second = tl.load(rope + HALF + pair, mask=in_half, other=0.0)
            cos_row, sin_row = cos_ptr + token * stride_cos, sin_ptr + token * stride_cos
            first, second = rotate_half_pair(first, second, cos_row, sin_row, pair, in_half, HALF)
            out_row = out_head + token * num_heads * width + latent
            tl.store(out_row + pair, first, mask=in_half)
            tl.store(out_row + HALF + pair, second, mask=in_half)
            if WITH_KEY and head == 0:
                key_row = key_out_ptr + token * (latent + 2 * HALF)
                kv_row = kv_ptr + token * stride_kv
                args = (norm_weight_ptr, cos_row, sin_row, key_row, latent, eps)
                _latent_key_row(kv_row, *args, HALF, BLOCK_LATENT, BLOCK_HALF)
    else:
        dims = tl.arange(0, BLOCK_NOPE)
        cols = block * BLOCK_L + tl.arange(0, BLOCK_L)
        in_cols = cols < latent
        w_rows = key_up_ptr + head * stride_w_head + dims[:, None] * stride_w_row
        weights = tl.load(w_rows + cols[None, :], mask=(dims < nope)[:, None] & in_cols[None, :], other=0.0)
        wait_for_inputs(DEPENDENT)
        for token in range(tokens):
            q_row = query_ptr + token * stride_q_token + head * stride_q_head
            q = tl.load(q_row + dims, mask=dims < nope, other=0.0).to(tl.float32)
            absorbed = tl.sum(weights.to(tl.float32) * q[:, None], axis=0)
            out_row = out_head + token * num_heads * width
            tl.store(out_row + cols, absorbed.to(out_ptr.dtype.element_ty), mask=in_cols)


def absorb_query(
    query: torch.Tensor, key_up: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key: LatentKey | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ops.absorb_query` in one launch (for a few rows: each program loops over them), and
    with `key`, `ops.latent_key` of its rows in the same launch: (absorbed query, key or None)."""
    tokens, heads, _ = query.shape
    nope, latent = key_up.shape[1:]
    rope = cos.shape[-1]
    out = torch.empty((tokens, heads, latent + rope), dtype=query.dtype, device=query.device)
    key_out = None if key is None else torch.empty((tokens, 1, latent + rope), dtype=query.dtype, device=query.device)
    if tokens:
        # Without a key, any pointers stand in for its inputs and output (WITH_KEY off).
        kv, weight, eps = (key.kv, key.weight, key.eps) if key is not None else (query, query, 0.0)
        _absorb_query_kernel[(heads, triton.cdiv(latent, ABSORB_BLOCK) + 1)](
            query,
            key_up,
            cos,
            sin,
            out,
            kv,
            weight,
            out if key_out is None else key_out,
            tokens,
            query.stride(0),
            query.stride(1),
            key_up.stride(0),
            key_up.stride(1),
            cos.stride(0),
            kv.stride(0),
            heads,
            nope,
            latent,
            eps,
            HALF=rope // 2,
            BLOCK_NOPE=triton.next_power_of_2(nope),
            BLOCK_L=ABSORB_BLOCK,
            BLOCK_HALF=triton.next_power_of_2(rope // 2),
            BLOCK_LATENT=triton.next_power_of_2(latent),
            WITH_KEY=key is not None,
            **dependent_launch_args(query.device),
        )
    return out, key_out


# The row count changes from step to step: a compiled variant for each would stall serving.
@triton.jit(do_not_specialize=("tokens",))
def _latent_values_kernel(
    attended_ptr,
    value_up_ptr,
    out_ptr,
    tokens,
    stride_a_token,
    stride_a_head,
    stride_w_head,
    stride_w_row,
    num_heads,
    value_dim,
    latent,
    BLOCK_V: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """Program (head, block): for every row, BLOCK_V of the head's value dims, its attended
    latent times those rows of the value up-projection, in float32, rounded once; written
    where the output projection reads them ([rows, heads x value_dim])."""
    head = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_LATENT)
    in_dims, in_cols = dims < value_dim, cols < latent
    w_rows = value_up_ptr + head * stride_w_head + dims[:, None] * stride_w_row
    weights = tl.load(w_rows + cols[None, :], mask=in_dims[:, None] & in_cols[None, :], other=0.0)
    wait_for_inputs(DEPENDENT)
    for token in range(tokens):
        a_row = attended_ptr + token * stride_a_token + head * stride_a_head
        attended = tl.load(a_row + cols, mask=in_cols, other=0.0).to(tl.float32)
        values = tl.sum(weights.to(tl.float32) * attended[None, :], axis=1)
        out_row = out_ptr + (token * num_heads + head) * value_dim
        tl.store(out_row + dims, values.to(out_ptr.dtype.element_ty), mask=in_dims)


def latent_values(attended: torch.Tensor, value_up: torch.Tensor) -> torch.Tensor:
    """`ops.latent_values` in one launch (for a few rows: each program loops over them)."""
    tokens, heads, latent = attended.shape
    value_dim = value_up.shape[1]
    out = torch.empty((tokens, heads * value_dim), dtype=attended.dtype, device=attended.device)
    if tokens:
        block = min(VALUES_BLOCK, triton.next_power_of_2(value_dim))
        _latent_values_kernel[(heads, triton.cdiv(value_dim, block))](
            attended,
            value_up,
            out,
            tokens,
            attended.stride(0),
            attended.stride(1),
            value_up.stride(0),
            value_up.stride(1),
            heads,
            value_dim,
            latent,
            BLOCK_V=block,
            BLOCK_LATENT=triton.next_power_of_2(latent),
            **dependent_launch_args(attended.device),
        )
    return out


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    stride_gate_token,
    stride_gate_head,
    num_heads,
    dim,
    eps,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """HEADS heads of one token: norm(x) * weight (rounded as `_rms_norm_kernel` rounds) times
    silu(gate) in float32, rounded once."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    mask = (heads < num_heads)[:, None] & inside[None, :]
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    wait_for_inputs(DEPENDENT)
    rows = (token * num_heads + heads)[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + rows, mask=mask, other=0.0)
    gate_rows = gate_ptr + token * stride_gate_token + heads[:, None] * stride_gate_head + cols[None, :]
    gate = tl.load(gate_rows, mask=mask, other=0.0).to(tl.float32)
    x32 = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / dim + eps)
    normed = (weight[None, :] * (x32 * inverse_rms[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + rows, (normed * gate * tl.sigmoid(gate)).to(x.dtype), mask=mask)


# Heads one gating program takes: a program per (token, head) moved 256 bytes, and a
# prefill of 8,000 tokens launched 260,000 of them per layer (1.3 ms on an H100).
GATE_HEADS = 16


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight * silu(gate) per head: x [tokens, heads, dim], gate the same shape at
    any token and head strides (a projection's columns). One launch where five ran."""
    tokens, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        per_program = min(GATE_HEADS, triton.next_power_of_2(heads))
        _gated_rms_norm_kernel[(tokens, triton.cdiv(heads, per_program))](
            x,
            gate,
            weight,
            out,
            gate.stride(0),
            gate.stride(1),
            heads,
            dim,
            eps,
            BLOCK=triton.next_power_of_2(dim),
            HEADS=per_program,
            **dependent_launch_args(x.device),
        )
    return out


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,
    stride_gate_token,
    stride_gate_head,
    num_heads,
    dim,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """HEADS heads of one token: x * sigmoid(gate), the sigmoid rounded to x's dtype first as
    torch rounds it."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    mask = (heads < num_heads)[:, None] & (cols < dim)[None, :]
    wait_for_inputs(DEPENDENT)
    rows = (token * num_heads + heads)[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + rows, mask=mask, other=0.0)
    gate_rows = gate_ptr + token * stride_gate_token + heads[:, None] * stride_gate_head + cols[None, :]
    gate = tl.load(gate_rows, mask=mask, other=0.0).to(tl.float32)
    scale = tl.sigmoid(gate).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + rows, (x.to(tl.float32) * scale).to(x.dtype), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] * sigmoid(gate), gate the same shape at any token and head
    strides (each head's gate beside its query in the projection): one launch where a copy,
    a sigmoid and a product ran."""
    tokens, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        per_program = min(GATE_HEADS, triton.next_power_of_2(heads))
        _sigmoid_gate_kernel[(tokens, triton.cdiv(heads, per_program))](
            x,
            gate,
            out,
            gate.stride(0),
            gate.stride(1),
            heads,
            dim,
            BLOCK=triton.next_power_of_2(dim),
            HEADS=per_program,
            **dependent_launch_args(x.device),
        )
    return out
