"""Every Triton kernel compiles for a Hopper GPU, here on the CPU.

Triton's interpreter (which runs the kernels in CI) accepts code that the compiler refuses,
such as a function whose returns give different types; compiling for sm_90 catches that
without a GPU. Each case is a kernel with the constants of one real launch. The compiler
needs the kernels as compiled functions, not as the interpreter's: one child process with the
interpreter off compiles them all (`python -m tests.core.test_triton_compiles`).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kestrel.core.attention import triton_kernels as attention
from kestrel.core.attention import triton_mla
from kestrel.layers import fp8_matmul, fused, fused_moe, gated_delta_kernels, gemv, int4_matmul

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_MEMORY = 227 * 1024  # per program, at most
LAUNCH_OPTIONS = {"num_warps": 4, "num_stages": 2}
BF16_ROW = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
FOLDED_NORM = {"norm_ptr": "*bf16", "residual_ptr": "*bf16"}  # a layer's RMS norm inside its matvecs
ATTENTION = {"query_ptr": "*bf16", "out_ptr": "*bf16", "seq_lens_ptr": "*i32", "page_table_ptr": "*i32"}
ATTENTION |= {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "scale": "fp32"}
ATTENTION |= {"query_start_ptr": "*i32", "num_cached_ptr": "*i32"}
FLOAT8_POOL = {"key_cache_ptr": "*fp8e4nv", "value_cache_ptr": "*fp8e4nv"}
BF16_POOL = {"key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16"}
MOE_MATMUL = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*bf16"}
MOE_MATMUL |= {"row_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
MOE_GROUPING = {"experts_ptr": "*i32", "cursors_ptr": "*i32", "row_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
MOE_GROUPING |= {"counts_ptr": "*i32"}
RECURRENT_STEP = {"query_start_ptr": "*i32", "slots_ptr": "*i64", "read_slots_ptr": "*i64", "save_slots_ptr": "*i64"}
RECURRENT_STEP |= {"has_state_ptr": "*i1"}
DECODE = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=64, PRECISION="tf32", HAS_SINKS=False)

MOE_ROUTE = {
    "logits_ptr": "*bf16",
    "shared_logits_ptr": "*bf16",
    "weights_ptr": "*bf16",
    "experts_ptr": "*i32",
    "routed_scale": "fp32",
}
GATED_DELTA = RECURRENT_STEP | {"out_ptr": "*bf16", "scale": "fp32"}
GATED_DELTA |= {"mixed_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*bf16", "dt_bias_ptr": "*bf16"}
QWEN3_NEXT_DELTA = dict(NUM_KEY_HEADS=16, NUM_VALUE_HEADS=32, KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32)
QWEN3_NEXT_DELTA |= dict(DEPENDENT=True)
CASES = {
    "gemv": (
        gemv._gemv_kernel,
        BF16_ROW,
        dict(HAS_BIAS=True, HAS_SCALE=False, NORMED=False, HAS_RESIDUAL=False, DEPENDENT=True, BLOCK_N=2, BLOCK_K=2048),
    ),
    "gemv_folded": (  # the norm before it inside, and the residual after it
        gemv._gemv_kernel,
        BF16_ROW | FOLDED_NORM,
        dict(HAS_BIAS=True, HAS_SCALE=False, NORMED=True, HAS_RESIDUAL=True, DEPENDENT=True, BLOCK_N=2, BLOCK_K=2048),
    ),
    "gemv_float8": (
        gemv._gemv_kernel,
        BF16_ROW | {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
        dict(HAS_BIAS=False, HAS_SCALE=True, NORMED=False, HAS_RESIDUAL=False, DEPENDENT=True, BLOCK_N=2, BLOCK_K=4096),
    ),
    "fp8_few_rows": (  # a decode step of up to 16 rows over float8 weights
        fp8_matmul._few_rows_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16"},
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DEPENDENT=True),
    ),
    "int4_gemv": (  # a 4096-wide bf16 projection's codes, widened in registers
        int4_matmul.int4_gemv_kernel,
        BF16_ROW | {"codes_ptr": "*i32", "scales_ptr": "*bf16", "zeros_ptr": "*bf16"},
        dict(GROUP=128, HAS_BIAS=False, BLOCK_N=4, BLOCK_K=1024, DEPENDENT=True),
    ),
    "int4_matmul": (
        int4_matmul.int4_matmul_kernel,
        {"a_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16", "codes_ptr": "*i32"}
        | {"scales_ptr": "*bf16", "zeros_ptr": "*bf16"},
        dict(GROUP=128, HAS_BIAS=True, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, PRECISION="tf32", DEPENDENT=True),
    ),
    "quantize_rows_float8": (
        fp8_matmul._quantize_rows_kernel,
        {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
        dict(BLOCK_K=4096, WHOLE_ROW=True, DEPENDENT=True),
    ),
    "gemv_silu_and_mul": (
        gemv._gemv_silu_and_mul_kernel,
        BF16_ROW | FOLDED_NORM,
        dict(HAS_SCALE=False, NORMED=True, DEPENDENT=True, BLOCK_N=1, BLOCK_K=4096),
    ),
    "gemv_silu_and_mul_float8": (  # a float8 MLP at one row, its norm folded
        gemv._gemv_silu_and_mul_kernel,
        BF16_ROW | FOLDED_NORM | {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
        dict(HAS_SCALE=True, NORMED=True, DEPENDENT=True, BLOCK_N=2, BLOCK_K=4096),
    ),
    "gemv_rotary": (
        gemv._gemv_rotary_kernel,
        BF16_ROW | {"cos_ptr": "*bf16", "sin_ptr": "*bf16"},
        dict(HALF=64, HAS_BIAS=False, HAS_SCALE=False, NORMED=False, DEPENDENT=True, BLOCK_N=2, BLOCK_K=1024),
    ),
    "gemv_rotary_float8": (
        gemv._gemv_rotary_kernel,
        BF16_ROW | FOLDED_NORM | {"cos_ptr": "*bf16", "sin_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
        dict(HALF=64, HAS_BIAS=False, HAS_SCALE=True, NORMED=True, DEPENDENT=True, BLOCK_N=2, BLOCK_K=4096),
    ),
    "rms_norm": (
        fused._rms_norm_kernel,
        BF16_ROW | {"residual_ptr": "*bf16", "weight_ptr": "*bf16", "residual_out_ptr": "*bf16", "eps": "fp32"},
        dict(HAS_RESIDUAL=True, DEPENDENT=True, BLOCK=4096),
    ),
    "rotary": (
        fused._rotary_kernel,
        {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
        dict(HALF=64, BLOCK=64, HEADS=16, DEPENDENT=True),
    ),
    "qk_norm_rotary": (
        fused._qk_norm_rotary_kernel,
        {"x_ptr": "*bf16", "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"}
        | {"eps": "fp32"},
        dict(HALF=64, BLOCK=64, HEADS=16, DEPENDENT=True),
    ),
    "store_kv_float8": (
        attention.store_kv_kernel,
        FLOAT8_POOL | {"key_ptr": "*bf16", "value_ptr": "*bf16", "slot_ptr": "*i64"},
        dict(PAGE=16, HEAD_DIM=128, BLOCK_D=128, HEADS=8, DEPENDENT=True),
    ),
    "decode_float8": (
        attention.decode_kernel,
        ATTENTION | FLOAT8_POOL,
        DECODE | dict(SPLIT=False, DOTS_IN_FP16=True, VALUES_BY_SLOT=True, WHOLE_BLOCKS=False, DEPENDENT=True),
    ),
    "decode_split_bf16": (
        attention.decode_kernel,
        ATTENTION | BF16_POOL,
        DECODE | dict(SPLIT=True, DOTS_IN_FP16=False, VALUES_BY_SLOT=False, WHOLE_BLOCKS=True, DEPENDENT=True),
    ),
    # decode_launch's large-batch setting, with the widest pool it may read (float32).
    "decode_large_batch_float32": (
        attention.decode_kernel,
        ATTENTION | {"query_ptr": "*fp32", "key_cache_ptr": "*fp32", "value_cache_ptr": "*fp32"},
        DECODE
        | dict(BLOCK_N=128, PRECISION="ieee", SPLIT=False, DOTS_IN_FP16=False, VALUES_BY_SLOT=False)
        | dict(WHOLE_BLOCKS=False, DEPENDENT=True),
    ),
    "mla_decode_split_bf16": (  # DeepSeek's 512-dim latent and 64 rotary dims
        triton_mla.mla_decode_kernel,
        ATTENTION | {"cache_ptr": "*bf16"},
        dict(LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=16, PAGE=16, BLOCK_N=32, PRECISION="tf32")
        | dict(SPLIT=True, DEPENDENT=True),
    ),
    "decode_split_sinks_bf16": (
        attention.decode_kernel,
        ATTENTION | BF16_POOL | {"sinks_ptr": "*bf16"},
        DECODE
        | dict(GROUP=8, HEAD_DIM=64, BLOCK_D=64, HAS_SINKS=True, SPLIT=True, DOTS_IN_FP16=False)
        | dict(VALUES_BY_SLOT=False, WHOLE_BLOCKS=False, DEPENDENT=True),
    ),
    "mla_decode_float8": (  # a float8 latent pool, widened to bf16 as it is read
        triton_mla.mla_decode_kernel,
        ATTENTION | {"cache_ptr": "*fp8e4nv"},
        dict(LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=16, PAGE=16, BLOCK_N=32, PRECISION="tf32")
        | dict(SPLIT=False, DEPENDENT=True),
    ),
    "combine_splits": (
        attention.combine_splits_kernel,
        ATTENTION,
        dict(HEAD_DIM=128, BLOCK_D=128, SPLITS_PAD=16, DEPENDENT=True),
    ),
    "prefill_float8": (
        attention.prefill_kernel,
        ATTENTION | FLOAT8_POOL,
        dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, PAGE=16, BLOCK_N=64, PRECISION="tf32")
        | dict(DOTS_IN_FP16=True, VALUES_BY_SLOT=True, HAS_SINKS=False, DEPENDENT=True),
    ),
    "prefill_sinks_bf16": (  # GPT-OSS: 64 query heads of 64 dims over 8 KV heads, a sink each
        attention.prefill_kernel,
        ATTENTION | BF16_POOL | {"sinks_ptr": "*bf16"},
        dict(GROUP=8, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, PAGE=16, BLOCK_N=64, PRECISION="tf32")
        | dict(DOTS_IN_FP16=False, VALUES_BY_SLOT=False, HAS_SINKS=True, DEPENDENT=True),
    ),
    "moe_matmul_decode": (
        fused_moe.grouped_matmul_kernel,
        MOE_MATMUL,
        dict(A_ROW_DIVISOR=8, SCALE_BY_WEIGHT=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, PRECISION="tf32")
        | dict(HAS_SCALE=False, HAS_BIAS=False, ACTIVATION=0, WEIGHT_INPUT=False, DEPENDENT=True),
    ),
    "moe_matmul_tall": (
        fused_moe.grouped_matmul_kernel,
        MOE_MATMUL,
        dict(A_ROW_DIVISOR=1, SCALE_BY_WEIGHT=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, PRECISION="tf32")
        | dict(HAS_SCALE=False, HAS_BIAS=False, ACTIVATION=0, WEIGHT_INPUT=False, DEPENDENT=True),
    ),
    "moe_matmul_float8_experts": (  # gate and up with silu, float8 rows widened in registers
        fused_moe.grouped_matmul_kernel,
        MOE_MATMUL | {"b_ptr": "*fp8e4nv", "scales_ptr": "*fp32"},
        dict(A_ROW_DIVISOR=8, SCALE_BY_WEIGHT=False, SILU_AND_MUL=True, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128)
        | dict(PRECISION="tf32", HAS_SCALE=True, HAS_BIAS=False, ACTIVATION=0, WEIGHT_INPUT=False, DEPENDENT=True),
    ),
    "moe_matmul_gpt_oss": (  # biases and the clamped SwiGLU
        fused_moe.grouped_matmul_kernel,
        MOE_MATMUL | {"bias_ptr": "*bf16"},
        dict(A_ROW_DIVISOR=4, SCALE_BY_WEIGHT=False, SILU_AND_MUL=True, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128)
        | dict(PRECISION="tf32", HAS_SCALE=False, HAS_BIAS=True, ACTIVATION=1, WEIGHT_INPUT=False, DEPENDENT=True),
    ),
    "moe_route_with_shared": (  # Qwen3-Next: top 10 of 512, the shared expert after them
        fused_moe.route_kernel,
        MOE_ROUTE,
        dict(TOP_K=10, NUM_SHARED=1, GATED=True, EXPERTS_POW2=512, SLOTS_POW2=16, RENORMALIZE=True, DEPENDENT=True),
    ),
    "moe_route_deepseek": (  # DeepSeek-V2-Lite: top 6 of 64 scaled, two shared experts weighted 1
        fused_moe.route_kernel,
        MOE_ROUTE,
        dict(TOP_K=6, NUM_SHARED=2, GATED=False, EXPERTS_POW2=64, SLOTS_POW2=8, RENORMALIZE=False, DEPENDENT=True),
    ),
    "moe_router_matvec_routes": (  # Qwen3-Next at one row: 512 routed rows and the shared gate's
        fused_moe._gemv_route_kernel,
        BF16_ROW | MOE_ROUTE | {"arrivals_ptr": "*i32", "norm_ptr": "*fp32"},
        dict(HAS_BIAS=False, TOP_K=10, NUM_SHARED=1, GATED=True, EXPERTS_POW2=512, SLOTS_POW2=16)
        | dict(RENORMALIZE=True, NORMED=True, DEPENDENT=True, BLOCK_N=4, BLOCK_K=1024),
    ),
    "moe_expert_gate_up": (  # a decode token's routed rows, one matvec each
        fused_moe._expert_gate_up_kernel,
        {"x_ptr": "*bf16", "w13_ptr": "*bf16", "experts_ptr": "*i32", "out_ptr": "*bf16", "norm_ptr": "*bf16"}
        | {"eps": "fp32"},
        dict(WIDTH=8, HAS_SCALE=False, HAS_BIAS=False, ACTIVATION=0, WEIGHT_INPUT=False, NORMED=True, DEPENDENT=True)
        | dict(BLOCK_N=2, BLOCK_K=2048),
    ),
    "moe_expert_gate_up_gpt_oss": (
        fused_moe._expert_gate_up_kernel,
        {"x_ptr": "*bf16", "w13_ptr": "*bf16", "bias_ptr": "*bf16", "experts_ptr": "*i32", "out_ptr": "*bf16"},
        dict(WIDTH=4, HAS_SCALE=False, HAS_BIAS=True, ACTIVATION=1, WEIGHT_INPUT=False, NORMED=False, DEPENDENT=True)
        | dict(BLOCK_N=2, BLOCK_K=4096),
    ),
    "moe_expert_gate_up_float8": (
        fused_moe._expert_gate_up_kernel,
        {"x_ptr": "*bf16", "w13_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "experts_ptr": "*i32", "out_ptr": "*bf16"},
        dict(WIDTH=8, HAS_SCALE=True, HAS_BIAS=False, ACTIVATION=0, WEIGHT_INPUT=False, NORMED=False, DEPENDENT=True)
        | dict(BLOCK_N=2, BLOCK_K=2048),
    ),
    "moe_expert_down_sum": (
        fused_moe._expert_down_sum_kernel,
        {
            "activated_ptr": "*bf16",
            "w2_ptr": "*bf16",
            "experts_ptr": "*i32",
            "weights_ptr": "*bf16",
            "out_ptr": "*bf16",
            "residual_ptr": "*bf16",
        },
        dict(WIDTH=11, CHOICES=16, HAS_SCALE=False, HAS_BIAS=False, WEIGHTED=True, HAS_RESIDUAL=True, DEPENDENT=True)
        | dict(BLOCK_N=2, BLOCK_K=256),
    ),
    "moe_expert_down_sum_float8": (
        fused_moe._expert_down_sum_kernel,
        {"activated_ptr": "*bf16", "w2_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "experts_ptr": "*i32"}
        | {"weights_ptr": "*bf16", "out_ptr": "*bf16", "bias_ptr": "*bf16"},
        dict(WIDTH=8, CHOICES=8, HAS_SCALE=True, HAS_BIAS=True, WEIGHTED=True, HAS_RESIDUAL=False, DEPENDENT=True)
        | dict(BLOCK_N=2, BLOCK_K=256),
    ),
    "head_norm_partial_rotary": (  # Qwen3-Next: 64 of 256 columns rotated, a float32 folded weight
        fused._head_norm_rotary_kernel,
        {"x_ptr": "*bf16", "weight_ptr": "*fp32", "out_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"}
        | {"eps": "fp32"},
        dict(HALF_ROTARY=32, BLOCK=256, HEADS=16, DEPENDENT=True),
    ),
    "latent_key": (  # DeepSeek-V2-Lite: a 512-wide latent normed, 64 rope columns rotated
        fused._latent_key_kernel,
        {"kv_ptr": "*bf16", "weight_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16"}
        | {"eps": "fp32"},
        dict(HALF=32, BLOCK_LATENT=512, BLOCK_HALF=32, DEPENDENT=True),
    ),
    "absorb_query": (  # DeepSeek-V2-Lite: 128 nope dims into a 512-wide latent, 64 rope columns
        fused._absorb_query_kernel,
        {"query_ptr": "*bf16", "key_up_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16"}
        | {"kv_ptr": "*bf16", "norm_weight_ptr": "*bf16", "key_out_ptr": "*bf16", "eps": "fp32"},
        dict(HALF=32, BLOCK_NOPE=128, BLOCK_L=fused.ABSORB_BLOCK, BLOCK_HALF=32, BLOCK_LATENT=512, DEPENDENT=True)
        | dict(WITH_KEY=True),
    ),
    "latent_values": (  # DeepSeek-V2-Lite: 128 value dims a head from its 512-wide latent
        fused._latent_values_kernel,
        {"attended_ptr": "*bf16", "value_up_ptr": "*bf16", "out_ptr": "*bf16"},
        dict(BLOCK_V=fused.VALUES_BLOCK, BLOCK_LATENT=512, DEPENDENT=True),
    ),
    "gated_rms_norm": (
        fused._gated_rms_norm_kernel,
        {"x_ptr": "*bf16", "gate_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
        dict(BLOCK=128, HEADS=16, DEPENDENT=True),
    ),
    "sigmoid_gate": (
        fused._sigmoid_gate_kernel,
        {"x_ptr": "*bf16", "gate_ptr": "*bf16", "out_ptr": "*bf16"},
        dict(BLOCK=256, HEADS=16, DEPENDENT=True),
    ),
    "moe_count_rows": (fused_moe.count_rows_kernel, MOE_GROUPING, dict(BLOCK=256, DEPENDENT=True)),
    "moe_expert_runs": (  # Qwen3-Next: 512 routed experts and the shared one stacked after them
        fused_moe.expert_runs_kernel,
        MOE_GROUPING,
        dict(NUM_EXPERTS=513, EXPERTS_POW2=1024, BLOCK_M=16, CHUNK=64, DEPENDENT=True),
    ),
    "moe_place_rows": (fused_moe.place_rows_kernel, MOE_GROUPING, dict(BLOCK=256, DEPENDENT=True)),
    "causal_conv": (
        gated_delta_kernels.causal_conv_kernel,
        RECURRENT_STEP | {"x_ptr": "*bf16", "out_ptr": "*bf16", "prior_ptr": "*bf16", "weight_ptr": "*bf16"},
        dict(WIDTH=3, WIDTH_POW2=4, BLOCK_C=256, DEPENDENT=True),
    ),
    "gated_delta": (gated_delta_kernels.gated_delta_kernel, GATED_DELTA | {"state_ptr": "*fp32"}, QWEN3_NEXT_DELTA),
    "gated_delta_bf16_state": (  # mamba_ssm_cache_dtype="bfloat16"
        gated_delta_kernels.gated_delta_kernel,
        GATED_DELTA | {"state_ptr": "*bf16"},
        QWEN3_NEXT_DELTA,
    ),
}


def compile_for_hopper(name: str) -> dict[str, str | int]:
    """The PTX and shared memory of one case, or what the compiler said."""
    kernel, pointer_types, constants = CASES[name]
    params = list(inspect.signature(kernel.fn).parameters)
    if not set(constants) <= set(params):
        return {"ptx": f"unknown constants {set(constants) - set(params)}", "shared": 0}
    signature = {p: "constexpr" if p in constants else pointer_types.get(p, "i32") for p in params}
    constexprs = {(params.index(k),): v for k, v in constants.items()}
    # As a launch specializes them: pointers and strides divisible by 16, so loads vectorize.
    aligned = [i for i, p in enumerate(params) if p not in constants and (p.endswith("_ptr") or p.startswith("stride"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    try:
        source = ASTSource(kernel, signature, constexprs, attrs)
        compiled = triton.compile(source, target=HOPPER, options=LAUNCH_OPTIONS)
    except Exception as error:  # reported by the test, per kernel
        return {"ptx": f"{type(error).__name__}: {error}", "shared": 0}
    return {"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared}


@pytest.fixture(scope="module")
def compiled_cases() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = [sys.executable, "-m", "tests.core.test_triton_compiles"]
    result = subprocess.run(child, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", CASES)
def test_kernel_compiles_for_hopper(name, compiled_cases):
    ptx, shared = compiled_cases[name]["ptx"], compiled_cases[name]["shared"]
    assert ".target sm_90" in ptx, ptx[-3000:]
    assert shared <= HOPPER_SHARED_MEMORY
    # A kernel launched as dependent waits for the one before it (dependent_launch.py).
    assert ("griddepcontrol.wait" in ptx) == CASES[name][2].get("DEPENDENT", False)


def test_float8_decode_reads_shared_memory_in_vectors(compiled_cases):
    """Why a float8 pool stores values slot-minor (KVLayerCache): read key-major, the
    values' tile reached the second dot byte by byte from shared memory."""
    for name in ("decode_float8", "prefill_float8"):
        ptx = compiled_cases[name]["ptx"]
        assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx, name


if __name__ == "__main__":
    print(json.dumps({name: compile_for_hopper(name) for name in CASES}))


def test_the_router_matvec_hands_its_logits_to_the_last_program_through_l2(compiled_cases):
    """The routing program reads logits other programs wrote: each program's threads meet at a
    barrier before one acquire-release atomic at GPU scope, and the logits are read past L1."""
    ptx = compiled_cases["moe_router_matvec_routes"]["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "bar.sync" in ptx
    assert "ld.global.cg" in ptx
