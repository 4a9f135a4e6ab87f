"""The gated delta rule's Triton kernels: the causal convolution and the recurrence over a
whole step's sequences (prefill chunks and decodes alike), each one launch.

`kestrel/layers/gated_delta.py` holds the torch reference and the formulas. Here the
recurrence runs token by token inside one program per (sequence, value head, block of value
columns), its state tile kept in registers from the first token of the chunk to the last:
no per-sequence launches and no state round trips between tokens. The query/key L2 norm,
the decay (softplus gating) and beta are computed in the kernel from the projection's raw
outputs, so nothing between the convolution and the recurrence runs in torch.

Both kernels find each sequence's rows through `query_start` on the device and read nothing
back to the host, so a decode step can be captured in a CUDA graph.

A long prefill through the token-by-token recurrence is serial work: about 5 ms a layer for
8,000 prompt tokens on an H100. flash-linear-attention (fla-core, the optional extra
`linear-attention`) carries chunked kernels for the same rule, which turn each 64-token chunk
into tensor-core matmuls; where it is installed, a CUDA step's half-precision prefill rows take
them (`gated_delta_chunked`) and its decode rows keep the recurrence. They cannot run under
Triton's interpreter, so the recurrence stays the kernel CI checks against the torch reference,
and the chunked path is checked against the recurrence on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kestrel.core.metadata import PrefillChunks
from kestrel.core.runtime.dependent_launch import dependent_launch_args, wait_for_inputs

# Each sequence's slot ids and start row: rows of one per-step array (or slices of it), so
# their 16-byte alignment changes with the step's sequence count. Triton would compile a
# variant per alignment, stalling serving mid-run; these loads are tiny, so it need not know.
STEP_VECTORS = ("query_start_ptr", "slots_ptr", "read_slots_ptr", "save_slots_ptr", "has_state_ptr")


@triton.jit(do_not_specialize_on_alignment=STEP_VECTORS)
def causal_conv_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    prior_ptr,
    stride_prior_slot,
    weight_ptr,
    query_start_ptr,
    slots_ptr,
    read_slots_ptr,
    save_slots_ptr,
    has_state_ptr,
    channels,
    WIDTH: tl.constexpr,
    WIDTH_POW2: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One sequence's rows for a block of channels: out = silu(conv(prior ++ x)) with the
    prior read from the sequence's read slot, then the last WIDTH inputs become the prior of
    its slot and of its save slot. prior [slots, channels, WIDTH]; weight [channels,
    WIDTH + 1]. The program owns its (slot, channels), so it may overwrite what it read."""
    wait_for_inputs(DEPENDENT)
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < channels
    start = tl.load(query_start_ptr + seq)
    length = tl.load(query_start_ptr + seq + 1) - start
    keep = tl.load(has_state_ptr + seq) != 0
    channel_offsets = offs_c * WIDTH
    prior = prior_ptr + tl.load(read_slots_ptr + seq).to(tl.int64) * stride_prior_slot + channel_offsets
    for i in range(0, length):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(WIDTH + 1):
            source = i - WIDTH + j  # the input tap j reads: a row of x, or one the prior kept
            row = (start + source).to(tl.int64)
            from_x = tl.load(x_ptr + row * stride_x + offs_c, mask=in_c & (source >= 0), other=0.0)
            from_prior = tl.load(prior + WIDTH + source, mask=in_c & (source < 0) & keep, other=0.0)
            tap = tl.load(weight_ptr + offs_c * (WIDTH + 1) + j, mask=in_c, other=0.0)
            acc += (from_x.to(tl.float32) + from_prior.to(tl.float32)) * tap.to(tl.float32)
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + i).to(tl.int64) * stride_out + offs_c, out.to(out_ptr.dtype.element_ty), mask=in_c)
    # The prior becomes the last WIDTH inputs of (prior ++ x): all read, then all written.
    taps = tl.arange(0, WIDTH_POW2)
    source = length - WIDTH + taps
    rows = (start + source).to(tl.int64)
    in_tap = in_c[:, None] & (taps < WIDTH)[None, :]
    from_x = tl.load(
        x_ptr + rows[None, :] * stride_x + offs_c[:, None], mask=in_tap & (source >= 0)[None, :], other=0.0
    )
    old = prior[:, None] + WIDTH + source[None, :]
    from_prior = tl.load(old, mask=in_tap & (source < 0)[None, :] & keep, other=0.0)
    kept = from_x.to(tl.float32) + from_prior.to(tl.float32)
    tl.debug_barrier()  # no thread overwrites a prior value another has still to read
    kept = kept.to(prior_ptr.dtype.element_ty)
    new_prior = channel_offsets[:, None] + taps[None, :]
    slot, save = tl.load(slots_ptr + seq).to(tl.int64), tl.load(save_slots_ptr + seq).to(tl.int64)
    tl.store(prior_ptr + slot * stride_prior_slot + new_prior, kept, mask=in_tap)
    tl.store(prior_ptr + save * stride_prior_slot + new_prior, kept, mask=in_tap)


def causal_conv_varlen(
    x: torch.Tensor,
    prior: torch.Tensor,
    weight: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    read_slots: torch.Tensor | None = None,
    save_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every sequence of a step through the depthwise causal convolution and SiLU.

    x [tokens, channels] (rows of sequence i: query_start[i] to query_start[i + 1]); prior
    [slots, channels, width], updated in place; weight [channels, width + 1]. Each sequence
    starts from the prior in its read slot (its slot by default), zero inputs where
    has_state is false, and leaves its new prior in its slot and its save slot."""
    tokens, channels = x.shape
    width = prior.shape[-1]
    out = torch.empty_like(x)
    block_c = min(256, triton.next_power_of_2(channels))
    grid = (slots.numel(), triton.cdiv(channels, block_c))
    causal_conv_kernel[grid](
        x,
        x.stride(0),
        out,
        out.stride(0),
        prior,
        prior.stride(0),
        weight,
        query_start,
        slots,
        slots if read_slots is None else read_slots,
        slots if save_slots is None else save_slots,
        has_state,
        channels,
        WIDTH=width,
        WIDTH_POW2=triton.next_power_of_2(width),
        BLOCK_C=block_c,
        **dependent_launch_args(x.device),
    )
    return out


@triton.jit
def _token_inputs(
    mixed_ptr, stride_mixed, a_ptr, b_ptr, stride_gates, head, t, end, q_cols, k_cols, v_cols, in_k, in_v
):
    """Token t's q, k, v rows and raw gates a, b, in float32 (zeros past `end`)."""
    valid = t < end
    row = mixed_ptr + t * stride_mixed
    q = tl.load(row + q_cols, mask=in_k & valid, other=0.0).to(tl.float32)
    k = tl.load(row + k_cols, mask=in_k & valid, other=0.0).to(tl.float32)
    v = tl.load(row + v_cols, mask=in_v & valid, other=0.0).to(tl.float32)
    gates = t * stride_gates + head
    a = tl.load(a_ptr + gates, mask=valid, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + gates, mask=valid, other=0.0).to(tl.float32)
    return q, k, v, a, b


@triton.jit(do_not_specialize_on_alignment=STEP_VECTORS)
def gated_delta_kernel(
    mixed_ptr,
    stride_mixed,
    a_ptr,
    b_ptr,
    stride_gates,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    stride_state_slot,
    out_ptr,
    stride_out,
    query_start_ptr,
    slots_ptr,
    read_slots_ptr,
    save_slots_ptr,
    has_state_ptr,
    scale,
    NUM_KEY_HEADS: tl.constexpr,
    NUM_VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One (sequence, value head, block of value columns): the recurrence over the
    sequence's rows, from the state in its read slot to its slot and its save slot. mixed
    rows are the convolution's output [q | k | v] over all heads; state [slots, value heads,
    KEY_DIM, VALUE_DIM], computed in float32 and stored in its own dtype."""
    wait_for_inputs(DEPENDENT)
    seq = tl.program_id(1) // NUM_VALUE_HEADS
    head = tl.program_id(1) % NUM_VALUE_HEADS
    key_head = head // (NUM_VALUE_HEADS // NUM_KEY_HEADS)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_k, in_v = offs_k < KEY_DIM, offs_v < VALUE_DIM
    start = tl.load(query_start_ptr + seq)
    end = tl.load(query_start_ptr + seq + 1)
    keep = tl.load(has_state_ptr + seq) != 0
    head_tile = head * KEY_DIM * VALUE_DIM + offs_k[:, None] * VALUE_DIM + offs_v[None, :]
    tile = state_ptr + tl.load(read_slots_ptr + seq).to(tl.int64) * stride_state_slot + head_tile
    in_tile = in_k[:, None] & in_v[None, :]
    state = tl.load(tile, mask=in_tile & keep, other=0.0).to(tl.float32)  # a fresh sequence starts from zero
    decay_rate = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    q_offset = key_head * KEY_DIM
    k_offset = NUM_KEY_HEADS * KEY_DIM + key_head * KEY_DIM
    v_offset = 2 * NUM_KEY_HEADS * KEY_DIM + head * VALUE_DIM
    q_cols, k_cols, v_cols = q_offset + offs_k, k_offset + offs_k, v_offset + offs_v
    # Each token's inputs are requested one token ahead: the loads of token t + 1 are in
    # flight while token t's reductions run, where each token waited on its own.
    q, k, v, a, b = _token_inputs(
        mixed_ptr, stride_mixed, a_ptr, b_ptr, stride_gates, head, start, end, q_cols, k_cols, v_cols, in_k, in_v
    )
    for t in range(start, end):
        next_q, next_k, next_v, next_a, next_b = _token_inputs(
            mixed_ptr, stride_mixed, a_ptr, b_ptr, stride_gates, head, t + 1, end, q_cols, k_cols, v_cols, in_k, in_v
        )
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        a = a + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        beta = tl.sigmoid(b)
        state = state * tl.exp(decay_rate * softplus)
        delta = beta * (v - tl.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(
            out_ptr + t * stride_out + head * VALUE_DIM + offs_v,
            out.to(out_ptr.dtype.element_ty),
            mask=in_v,
        )
        q, k, v, a, b = next_q, next_k, next_v, next_a, next_b
    slot, save = tl.load(slots_ptr + seq).to(tl.int64), tl.load(save_slots_ptr + seq).to(tl.int64)
    stored = state.to(state_ptr.dtype.element_ty)  # float32, or a half-precision state pool
    tl.store(state_ptr + slot * stride_state_slot + head_tile, stored, mask=in_tile)
    tl.store(state_ptr + save * stride_state_slot + head_tile, stored, mask=in_tile)


def gated_delta_varlen(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_key_heads: int,
    read_slots: torch.Tensor | None = None,
    save_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every sequence of a step through the gated delta rule.

    mixed [tokens, q | k | v] after the convolution (q, k per key head, v per value head);
    a, b [tokens, value heads] the raw gate projections; a_log, dt_bias [value heads];
    state [slots, value heads, key_dim, value_dim] (float32, or bf16/fp16 where
    `mamba_ssm_cache_dtype` asks), updated in place: each sequence
    starts from its read slot (its slot by default; zeros where has_state is false) and
    leaves its state in its slot and its save slot. Returns the output [tokens, value heads,
    value_dim] in mixed's dtype."""
    num_value_heads, key_dim, value_dim = state.shape[1:]
    if a.stride(0) != b.stride(0):
        raise ValueError("a and b must share a row stride (views of one projection's output)")
    out = torch.empty((mixed.shape[0], num_value_heads, value_dim), dtype=mixed.dtype, device=mixed.device)
    block_v = min(32, triton.next_power_of_2(value_dim))
    grid = (triton.cdiv(value_dim, block_v), slots.numel() * num_value_heads)
    gated_delta_kernel[grid](
        mixed,
        mixed.stride(0),
        a,
        b,
        a.stride(0),
        a_log,
        dt_bias,
        state,
        state.stride(0),
        out,
        out.stride(0),
        query_start,
        slots,
        slots if read_slots is None else read_slots,
        slots if save_slots is None else save_slots,
        has_state,
        key_dim**-0.5,
        NUM_KEY_HEADS=num_key_heads,
        NUM_VALUE_HEADS=num_value_heads,
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=block_v,
        **dependent_launch_args(mixed.device),
    )
    return out


# Prefill rows from which a step's prefills take the chunked kernels: below them the
# token-by-token recurrence is as quick as their several launches.
CHUNKED_MIN_ROWS = 128
CHUNKED_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _chunked_kernels_installed() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def takes_chunked(mixed: torch.Tensor, prefill_rows: int) -> bool:
    """Whether a step's prefill rows take `gated_delta_chunked`: CUDA, half precision (its
    dots run on tensor cores, which would not keep a float32 model's exactness), enough rows,
    and flash-linear-attention installed."""
    return (
        mixed.is_cuda
        and mixed.dtype in CHUNKED_DTYPES
        and prefill_rows >= CHUNKED_MIN_ROWS
        and _chunked_kernels_installed()
    )


FLA_CHUNK = 64  # tokens per chunk of flash-linear-attention's gated delta rule


def gated_delta_chunked(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    prefills: PrefillChunks,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_key_heads: int,
    read_slots: torch.Tensor,
    save_slots: torch.Tensor,
) -> torch.Tensor:
    """`gated_delta_varlen` for prefill sequences, in chunks of 64 tokens whose products run
    as matmuls (flash-linear-attention's chunked gated delta rule, the WY form): a sequence's
    tokens cost a few tensor-core launches where the recurrence takes them one by one.
    `prefills` bounds the sequences from row 0 of `mixed`, in chunks of FLA_CHUNK tokens (the
    step's metadata makes them once for all its layers); the other arguments are
    `gated_delta_varlen`'s. Handed both, the library never derives them itself: its helper
    makes them on the host and copies them over blocking, a wait for the device in every layer.
    The gating (softplus decay, sigmoid beta) and the query/key L2 norms run inside its
    kernels, as in ours."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    num_value_heads, key_dim, value_dim = state.shape[1:]
    tokens, key_size = mixed.shape[0], num_key_heads * key_dim
    query, key, value = mixed.split((key_size, key_size, num_value_heads * value_dim), dim=-1)
    starting = torch.where(has_state[:, None, None, None], state[read_slots].float(), 0.0)
    out, final = chunk_gated_delta_rule(
        query.reshape(1, tokens, num_key_heads, key_dim),
        key.reshape(1, tokens, num_key_heads, key_dim),
        value.reshape(1, tokens, num_value_heads, value_dim),
        a.reshape(1, tokens, num_value_heads),
        b.reshape(1, tokens, num_value_heads),
        scale=key_dim**-0.5,
        initial_state=starting,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        cu_seqlens=prefills.bounds_on_device,
        cu_seqlens_cpu=prefills.bounds,
        chunk_indices=prefills.chunks_on_device,
        chunk_size=FLA_CHUNK,
        use_gate_in_kernel=True,
        A_log=a_log,
        dt_bias=dt_bias,
    )
    final = final.to(state.dtype)
    state[slots] = final
    state[save_slots] = final  # the slots again, or the snapshots the prefix cache keeps
    return out[0].to(mixed.dtype)
