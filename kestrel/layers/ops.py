"""Ops with a device-specific implementation: fused Triton kernels on CUDA, oneDNN matmuls
and plain torch on the CPU.

The one place that chooses between them, by the tensor's device (`runs_kernels`: tests
send CPU tensors down the kernel branches too, core/kernel_branches.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kestrel.core.kernel_branches import runs_kernels
from kestrel.core.runtime import cpu_kernels
from kestrel.layers.quantized import Fp8Weight, PackedWeight

# oneDNN's matmul beats the default BLAS path on the CPU from about 16 rows (batched decode
# steps; measured on a 2-core Xeon: the 64 x 512 x 64000 LM head, 20.7 -> 17.8 ms); below
# that its fixed cost loses to BLAS.
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# bf16 only where oneDNN has bf16 kernels for this CPU (AVX-512 BF16 or AMX): elsewhere its
# bf16 inner product fails to build ("could not create a primitive descriptor").
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
_ONEDNN_MIN_ROWS = 16
_GEMV_DTYPES = (torch.bfloat16, torch.float16)  # one-row CUDA linears may take layers/gemv.py
_LATENT_MATVEC_MAX_ROWS = 16  # latent attention's per-head projections as matvecs up to here


@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm (weight, eps) for a linear to apply to its input first. A one-row Triton
    matvec applies it as it reads the row, in every program (layers/gemv.py): the norm then
    costs no launch of its own. Any other path normalises first (`rms_norm`)."""

    weight: torch.Tensor
    eps: float


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None = None,
    use_gemv: bool = False,
    norm: RowNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), for 2-D `x`; of norm(x) with `norm`; plus `residual` (shaped as
    the output) with it, the bias then added to the rounded product (as a row-parallel
    linear adds it). `use_gemv`: a one-row CUDA input takes the Triton matvec
    (`choose_matvec_kernels` measured, at start-up, that it beats cuBLAS on this weight),
    which folds the norm and the residual in; a one-row float32 CPU input Kestrel's
    (`choose_cpu_matvecs`). A packed weight (layers/quantized.py) takes its own kernel, but for
    a float8 one at one row: the matvec too (`matvec_operands`)."""
    operands = matvec_operands(x, weight, use_gemv)
    if operands is not None:
        from kestrel.layers import gemv

        values, scale = operands
        return gemv.gemv(x, values, bias, scale=scale, norm=norm, residual=residual)
    if norm is not None:
        x = rms_norm(x, norm.weight, norm.eps)
    if residual is None:
        return _linear(x, weight, bias, use_gemv)
    out = _linear(x, weight, None, use_gemv)
    return (out if bias is None else out + bias) + residual


def _linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None, use_gemv: bool
) -> torch.Tensor:
    if isinstance(weight, PackedWeight):
        return weight.linear(x, bias)
    if (
        _ONEDNN_LINEAR
        and x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and x.dim() == 2
        and x.shape[0] >= _ONEDNN_MIN_ROWS
        and not torch.compiler.is_compiling()  # inductor lowers F.linear, not this op
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if takes_gemv(x, use_gemv):
        from kestrel.layers import gemv

        return gemv.gemv(x, weight, bias)
    if _takes_cpu_matvec(x, use_gemv):
        out = cpu_kernels.ops().float_matvec(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, use_gemv: bool = False, norm: RowNorm | None = None
) -> torch.Tensor:
    """silu_and_mul(x @ weight.T) (of norm(x) with `norm`) for a weight stacking the gate
    rows, then the up rows: one kernel where a one-row linear takes the Triton matvec."""
    operands = matvec_operands(x, weight, use_gemv)
    if operands is not None:
        from kestrel.layers import gemv

        values, scale = operands
        return gemv.gemv_silu_and_mul(x, values, norm=norm, scale=scale)
    return silu_and_mul(linear(x, weight, use_gemv=use_gemv, norm=norm))


@dataclass(frozen=True)
class HeadRotation:
    """The rotary embedding of a projection's first `heads` heads of `head_dim` columns (a
    qkv projection's query and key heads): cos and sin [tokens, rotary_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor
    heads: int
    head_dim: int


def linear_rotary(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None,
    rotation: HeadRotation,
    use_gemv: bool = False,
    norm: RowNorm | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) (of norm(x) with `norm`) with `rotation` applied: one kernel where
    a one-row linear takes the Triton matvec and the rotary dim is the head's."""
    operands = matvec_operands(x, weight, use_gemv)
    if rotation.cos.shape[-1] == rotation.head_dim and operands is not None:
        from kestrel.layers import gemv

        values, scale = operands
        return gemv.gemv_rotary(x, values, bias, rotation, norm=norm, scale=scale)
    out = linear(x, weight, bias, use_gemv, norm=norm)
    tokens, width = out.shape[0], rotation.heads * rotation.head_dim
    heads = out[:, :width].view(tokens, rotation.heads, rotation.head_dim)
    rotated = rotary(heads, rotation.cos, rotation.sin)
    if rotated is not heads:  # rotated out of place: the CPU, or a partial rotary dim on CUDA
        out[:, :width] = rotated.reshape(tokens, width)
    return out


def takes_gemv(x: torch.Tensor, use_gemv: bool) -> bool:
    """A one-row CUDA input of a weight `choose_matvec_kernels` marked takes layers/gemv.py;
    so does a one-row CPU input of any dtype where the kernels run on the CPU (tests)."""
    half_or_cpu = x.dtype in _GEMV_DTYPES or not x.is_cuda
    return use_gemv and runs_kernels(x) and x.dim() == 2 and x.shape[0] == 1 and half_or_cpu


def matvec_operands(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, use_gemv: bool
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What the one-row matvec (layers/gemv.py) reads for `weight` where `x` takes it: a dense
    weight that start-up measurement gave it (`use_gemv`), or a float8 weight's values with
    its per-row scales, which always take it (no other kernel reads them at one row). Its
    norm, residual, rotary and activation then fold into that launch as for bf16 weights.
    None where x takes another kernel."""
    if isinstance(weight, Fp8Weight):
        return (weight.values, weight.scales) if takes_gemv(x, True) else None
    if isinstance(weight, torch.Tensor) and takes_gemv(x, use_gemv):
        return weight, None
    return None


def _takes_cpu_matvec(x: torch.Tensor, use_gemv: bool) -> bool:
    """A one-row float32 CPU input of a weight `choose_cpu_matvecs` marked takes Kestrel's matvec."""
    return use_gemv and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
    if runs_kernels(x):
        from kestrel.layers import fused

        return fused.rms_norm(x, weight, eps, residual)
    if residual is not None:
        summed = x + residual
        return _torch_rms_norm(summed, weight, eps), summed
    return _torch_rms_norm(x, weight, eps)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # Same math in one fused kernel: no cast happens between normalising and weighting.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(x.dtype)  # a float32 weight (an offset norm's) too


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * width] holding gate then up."""
    if runs_kernels(gate_up):
        from kestrel.layers import fused

        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # The strided half is made contiguous first: elementwise kernels run far faster on it.
    return F.silu(gate.contiguous()).mul_(up)


def head_norm_rotary(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [tokens, heads, head_dim] RMS-normalised per head, then rotated on its first
    cos.shape[-1] columns (partial rotary too): one kernel on CUDA."""
    if runs_kernels(x) and x.stride(-1) == 1:
        from kestrel.layers import fused

        return fused.head_norm_rotary(x, weight, eps, cos, sin)
    return rotary(rms_norm(x.contiguous(), weight, eps), cos, sin)


@dataclass(frozen=True)
class LatentKey:
    """What latent attention's key is made from: the latent projection's rows kv [tokens,
    latent + rope] and the latent's RMS norm (`weight`, `eps`)."""

    kv: torch.Tensor
    weight: torch.Tensor
    eps: float


def latent_key(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Latent attention's key from its projection kv [tokens, latent + rope] (any row stride):
    the latent RMS-normalised by `weight`, the rope part (cos.shape[-1] wide) rotated; a new
    [tokens, 1, latent + rope]. One kernel on CUDA, where a copy, a norm, a rotary pass and a
    concatenation took four."""
    if runs_kernels(kv) and kv.stride(-1) == 1:
        from kestrel.layers import fused

        return fused.latent_key(kv, weight, eps, cos, sin)
    tokens, rope = kv.shape[0], cos.shape[-1]
    latent, key_rope = kv.split((kv.shape[1] - rope, rope), dim=-1)
    rotated = rotary(key_rope.reshape(tokens, 1, rope), cos, sin).view(tokens, rope)
    return torch.cat((rms_norm(latent.contiguous(), weight, eps), rotated), dim=-1).view(tokens, 1, -1)


def absorb_query(query: torch.Tensor, key_up: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Latent attention's query [tokens, heads, nope + rope] as its dots take it: each head's
    nope part times the head's key up-projection (key_up [heads, nope, latent]), then the
    rope part rotated; a new [tokens, heads, latent + rope]. One kernel on CUDA for a decode
    step's few rows."""
    if _absorbs_in_kernel(query, key_up, cos):
        from kestrel.layers import fused

        return fused.absorb_query(query, key_up, cos, sin)[0]
    nope = key_up.shape[1]
    # [heads, tokens, nope] @ [heads, nope, latent], back to [tokens, heads, latent].
    absorbed = torch.bmm(query[..., :nope].transpose(0, 1), key_up).transpose(0, 1)
    return torch.cat((absorbed, rotary(query[..., nope:], cos, sin)), dim=-1)


def latent_query_and_key(
    query: torch.Tensor, key_up: torch.Tensor, key: LatentKey, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`absorb_query` and `latent_key` of the same rows: at a decode step's few rows on CUDA
    one launch makes both (head 0's rope program makes the key), where two were a layer's."""
    if _absorbs_in_kernel(query, key_up, cos) and key.kv.stride(-1) == 1:
        from kestrel.layers import fused

        return fused.absorb_query(query, key_up, cos, sin, key)
    return absorb_query(query, key_up, cos, sin), latent_key(key.kv, key.weight, key.eps, cos, sin)


def _absorbs_in_kernel(query: torch.Tensor, key_up: torch.Tensor, cos: torch.Tensor) -> bool:
    row_major = query.stride(-1) == 1 and key_up.stride(-1) == 1 and cos.stride(-1) == 1
    return runs_kernels(query) and query.shape[0] <= _LATENT_MATVEC_MAX_ROWS and row_major


def latent_values(attended: torch.Tensor, value_up: torch.Tensor) -> torch.Tensor:
    """Each head's attended latent [tokens, heads, latent] up to its values through value_up
    [heads, value, latent]: [tokens, heads x value], as the output projection reads it. One
    kernel on CUDA for a decode step's few rows."""
    tokens, heads, _ = attended.shape
    row_major = attended.stride(-1) == 1 and value_up.stride(-1) == 1
    if runs_kernels(attended) and tokens <= _LATENT_MATVEC_MAX_ROWS and row_major:
        from kestrel.layers import fused

        return fused.latent_values(attended, value_up)
    values = torch.bmm(attended.transpose(0, 1), value_up.transpose(1, 2)).transpose(0, 1)
    return values.reshape(tokens, heads * value_up.shape[1])


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight * silu(gate) per head of x [tokens, heads, dim]; one kernel on CUDA."""
    if runs_kernels(x) and gate.stride(-1) == 1:
        from kestrel.layers import fused

        return fused.gated_rms_norm(x, gate, weight, eps)
    normed = rms_norm(x, weight, eps)
    return (normed * F.silu(gate.float())).to(x.dtype)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x [tokens, heads, dim]; one kernel on CUDA."""
    if runs_kernels(x) and gate.stride(-1) == 1:
        from kestrel.layers import fused

        return fused.sigmoid_gate(x, gate)
    return x * torch.sigmoid(gate)


def qk_norm_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMS norms of query [tokens, heads, dim] and key [tokens, kv heads, dim], then
    rotary on both. On CUDA, where the key heads follow the query heads in each row (a qkv
    projection's output) and the rotary dim is the whole head: one in-place kernel."""
    tokens, num_q_heads, head_dim = query.shape
    if runs_kernels(query) and _key_heads_follow(query, key) and cos.shape[-1] == head_dim:
        from kestrel.layers import fused

        heads = query.as_strided((tokens, num_q_heads + key.shape[1], head_dim), query.stride())
        fused.qk_norm_rotary_(heads, num_q_heads, q_weight, k_weight, eps, cos, sin)
        return query, key
    query, key = rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps)
    return rotary(query, cos, sin), rotary(key, cos, sin)


def _key_heads_follow(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether key's heads follow query's in each row of one tensor, at the same strides.
    The row stride counts only where there is more than one row: a one-token view takes the
    stride of its own width (a batch-1 decode step's q and k differ there)."""
    tokens, num_q_heads, head_dim = query.shape
    adjacent = key.data_ptr() == query.data_ptr() + num_q_heads * head_dim * query.element_size()
    compared = slice(0 if tokens > 1 else 1, None)
    return adjacent and query.stride()[compared] == key.stride()[compared]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by cos/sin [tokens, rotary_dim] (rotate-half layout)."""
    rotary_dim = cos.shape[-1]
    if runs_kernels(x) and rotary_dim == x.shape[-1] and x.stride(-1) == 1:
        from kestrel.layers import fused

        return fused.rotary_(x, cos, sin)
    rotated, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    first, second = rotated[..., :half], rotated[..., half:]
    rotate_half = torch.cat((-second, first), dim=-1)
    out = rotated * cos[:, None, :] + rotate_half * sin[:, None, :]
    return torch.cat((out, passthrough), dim=-1) if passthrough.numel() else out
