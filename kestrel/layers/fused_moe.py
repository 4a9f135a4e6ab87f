"""Fused mixture of experts for CUDA: grouped Triton matmuls over tokens sorted by expert.

The (token, choice) assignments are sorted by expert on the device and each expert's run is
padded to a whole number of row blocks, so every block of rows belongs to one expert. One
kernel launch then computes every expert's gate/up projection, another every down
projection (scaled by the routing weight). All shapes depend only on the token count, never
on the routing, so nothing is read back to the host and a step can be captured in a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.layers import ops

BLOCK_M = 16  # rows per block: small, since an expert often gets few tokens in decode
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def grouped_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    row_ids_ptr,
    block_experts_ptr,
    weights_ptr,
    num_rows,
    n,
    k,
    stride_a,
    stride_b_expert,
    stride_b_n,
    stride_c,
    A_ROW_DIVISOR: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[row] = A[row // A_ROW_DIVISOR] @ B[expert]^T for the block's rows (B is [n, k] per
    expert, as a linear layer's weight), optionally times weights[row]."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(row_ids_ptr + offs_m)
    # Padding rows hold num_rows; a block past the last expert's run has expert -1 and
    # computes nothing (masked, rather than returning early).
    valid = (rows < num_rows) & (expert >= 0)
    expert = tl.maximum(expert, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (rows // A_ROW_DIVISOR)[:, None] * stride_a
    b_cols = b_ptr + expert * stride_b_expert + offs_n[None, :] * stride_b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        in_k = start + offs_k < k
        a = tl.load(a_rows + (start + offs_k)[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_cols + (start + offs_k)[:, None], mask=in_k[:, None] & (offs_n < n)[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if SCALE_BY_WEIGHT:
        acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + rows[:, None] * stride_c + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n < n)[None, :],
    )


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Assignments [tokens, top_k] -> (row ids grouped by expert, padded per expert to whole
    blocks, padding rows = tokens * top_k; the expert of each block, -1 past the end)."""
    flat = experts.flatten()
    num_rows = flat.numel()
    capacity = num_rows + num_experts * (block_m - 1)  # the most padding the routing can need
    capacity = -(-capacity // block_m) * block_m
    # scatter_add, not bincount: bincount reads the largest id back to the host.
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


def _grouped_matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    row_ids: torch.Tensor,
    block_experts: torch.Tensor,
    num_rows: int,
    a_row_divisor: int,
    routing_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = weight.shape[1], weight.shape[2]
    out = torch.empty((num_rows, n), dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    grouped_matmul_kernel[grid](
        a,
        weight,
        out,
        row_ids,
        block_experts,
        routing_weights if routing_weights is not None else out,
        num_rows,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        A_ROW_DIVISOR=a_row_divisor,
        SCALE_BY_WEIGHT=routing_weights is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        # float32 models get exact float32 products (their outputs are compared with HF's).
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """hidden [tokens, h]; w13 [experts, 2 * inter, h] (gate then up); w2 [experts, h, inter];
    weights, experts [tokens, top_k]. Returns sum over choices of weight * expert(hidden)."""
    tokens, top_k = experts.shape
    num_rows = tokens * top_k
    row_ids, block_experts = sort_by_expert(experts, w13.shape[0])
    gate_up = _grouped_matmul(hidden, w13, row_ids, block_experts, num_rows, top_k)
    activated = ops.silu_and_mul(gate_up)
    flat_weights = weights.flatten().contiguous()
    down = _grouped_matmul(activated, w2, row_ids, block_experts, num_rows, 1, flat_weights)
    return down.view(tokens, top_k, -1).sum(dim=1)
