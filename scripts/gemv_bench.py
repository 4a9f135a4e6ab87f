"""One-row linears on the GPU: cuBLAS against the Triton matvec (layers/gemv.py), per
Llama-3-8B weight shape, as bytes read per second; which one `ops.linear` keeps; and, with
--sweep, the matvec's best launch configurations from a wide grid. Then the fused matvecs
(qkv with rotary, gate/up with SiLU-and-multiply) against the two kernels each replaces,
with dependent launch on and off. With --int4, the 4-bit matvec (layers/int4_matmul.py) per
decoder shape instead: its autotuned launch and a grid of launches, as 4-bit bytes read per
second (codes, scales and zeros), beside the bf16 Triton matvec on the same shape. With
--float8, the float8 matvec (`--quantization fp8` at one row: e4m3 weights, a scale per row):
its autotuned launch and a grid that includes loads twice as wide (a float8 element is half
a bf16 one, so a bf16-tuned block moves half the bytes), as float8 bytes read per second.

    python scripts/gemv_bench.py [--sweep | --int4 | --float8 [--few-rows]] [--dummy-config NAME]

With --dummy-config the shapes are that model's one-row linears (each distinct weight shape
that declares a `matvec_weight`, with how many layers hold it) instead of Llama-3-8B's.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton

from kestrel.core.runtime import dependent_launch
from kestrel.layers import fp8_matmul, fused, gemv, ops
from kestrel.layers.quantized import quantize_fp8

SHAPES = {  # name: (out_features, in_features), Llama-3-8B
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}


def model_shapes(name: str) -> dict[str, tuple[int, int]]:
    """The distinct matvec weight shapes of a built-in dummy shape, built on the meta device."""
    from kestrel.engine.composition import dummy_hf_config
    from kestrel.models.registry import recipe_for

    hf_config = dummy_hf_config(name)
    recipe = recipe_for(hf_config.architectures)
    with torch.device("meta"):
        model = recipe.build(recipe.spec(hf_config))
    counts: dict[tuple[int, int], int] = {}
    for module in model.modules():
        weight = getattr(module, "matvec_weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            counts[tuple(weight.shape)] = counts.get(tuple(weight.shape), 0) + 1
    return {f"{n}x{k} ({count})": (n, k) for (n, k), count in counts.items()}


def sweep_configs() -> list[triton.Config]:
    configs = []
    for block_n, block_k, warps, stages in itertools.product([1, 2, 4, 8, 16], [512, 1024, 2048, 4096], [4, 8], [1, 3]):
        if 2048 <= block_n * block_k <= 16384:
            configs.append(triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages))
    return configs


def tera_bytes_per_s(x: torch.Tensor, weights: list[torch.Tensor], matvec) -> float:
    weight = weights[0]
    milliseconds = gemv._milliseconds(x, weights, matvec) / gemv.TIMING_REPEATS
    return weight.numel() * weight.element_size() / milliseconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time every configuration of a wide grid")
    parser.add_argument("--int4", action="store_true", help="time the 4-bit matvec instead")
    parser.add_argument("--float8", action="store_true", help="time the float8 matvec instead")
    parser.add_argument("--few-rows", action="store_true", help="with --float8: only the steps of 2 to 16 rows")
    parser.add_argument("--dummy-config", help="that built-in shape's matvec weights instead of Llama-3-8B's")
    args = parser.parse_args()
    shapes = model_shapes(args.dummy_config) if args.dummy_config else SHAPES
    if args.int4:
        return int4_matvecs()
    if args.float8:
        if not args.few_rows:
            float8_matvecs(shapes)
        return float8_few_rows(shapes)
    configs = sweep_configs() if args.sweep else []
    print(f"{'layer':<18}{'cuBLAS TB/s':>12}{'Triton TB/s':>12}  kept")
    for name, (n, k) in shapes.items():
        weights = gemv._weights_beyond_cache(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cublas = tera_bytes_per_s(x, weights, gemv._cublas)
        triton_tuned = tera_bytes_per_s(x, weights, gemv._triton)
        kept = "triton" if gemv.prefers_gemv(weights[0]) else "cublas"
        print(f"{name:<18}{cublas:>12.2f}{triton_tuned:>12.2f}  {kept}")
        ranked = sorted(
            ((tera_bytes_per_s(x, weights, lambda x, w, c=c: gemv.gemv(x, w, config=c)), c) for c in configs),
            key=lambda pair: -pair[0],
        )
        for rate, config in ranked[:5]:
            print(f"    {rate:.2f} TB/s  {config.kwargs} warps={config.num_warps} stages={config.num_stages}")
    if not args.dummy_config:
        fused_matvecs()


def int4_matvecs() -> None:
    from kestrel.layers import int4_matmul
    from kestrel.layers.quantized import quantize_int4_cuda

    def matvec(config=None):
        def run(x, w):
            if config is None:
                return int4_matmul.int4_linear_cuda(x, w.codes, w.scales, w.zeros, w.group_size)
            out = torch.empty((1, w.codes.shape[0]), dtype=x.dtype, device=x.device)
            grid = (triton.cdiv(w.codes.shape[0], config.kwargs["BLOCK_N"]),)
            int4_matmul.int4_gemv_kernel[grid](
                x, w.codes, w.scales, w.zeros, out, out, w.codes.shape[0], x.shape[1], w.codes.stride(0),
                w.scales.stride(0), GROUP=w.group_size, HAS_BIAS=False, DEPENDENT=False, **config.all_kwargs(),
            )  # fmt: skip
            return out

        return run

    grid = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps)
        for n, k, warps in itertools.product([1, 2, 4, 8], [512, 1024, 2048, 4096], [4, 8])
        if 1024 <= n * k <= 16384
    ]
    print(f"{'layer':<14}{'bf16 TB/s':>10}{'int4 TB/s':>10}  autotuned launch; best of the grid")
    for name, (n, k) in list(SHAPES.items())[:-1]:  # the LM head stays bf16
        dense = gemv._weights_beyond_cache(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        packed = quantize_int4_cuda(dense[0])
        nbytes = sum(t.numel() * t.element_size() for t in (packed.codes, packed.scales, packed.zeros))
        weights = [packed] + [
            type(packed)(*(t.clone() for t in (packed.codes, packed.scales, packed.zeros))) for _ in dense[1:]
        ]

        def rate(run, x=x, weights=weights, nbytes=nbytes):
            return nbytes / (gemv._milliseconds(x, weights, run) / gemv.TIMING_REPEATS) / 1e9

        tuned = rate(matvec())
        chosen = int4_matmul._tuned_gemv_kernel.best_config
        ranked = sorted(((rate(matvec(c)), c) for c in grid), key=lambda pair: -pair[0])
        best = ", ".join(f"{r:.2f} {c.kwargs} w{c.num_warps}" for r, c in ranked[:3])
        print(f"{name:<14}{tera_bytes_per_s(x, dense, gemv._triton):>10.2f}{tuned:>10.2f}  {chosen}; {best}")


def float8_matvecs(shapes: dict[str, tuple[int, int]]) -> None:
    grid = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps)
        for n, k, warps in itertools.product([1, 2, 4, 8], [1024, 2048, 4096, 8192], [4, 8])
        if 4096 <= n * k <= 32768
    ]
    print(f"{'layer':<18}{'bf16 TB/s':>10}{'fp8 TB/s':>10}  autotuned launch; best three of the grid")
    for name, (n, k) in shapes.items():
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        scales = dense.float().abs().amax(dim=1) / 448.0
        weights = gemv._weights_beyond_cache((dense.float() / scales[:, None]).to(torch.float8_e4m3fn))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

        def rate(config=None, x=x, weights=weights, scales=scales, nbytes=n * k):
            def run(x, w):
                return gemv.gemv(x, w, config=config, scale=scales)

            return nbytes / (gemv._milliseconds(x, weights, run) / gemv.TIMING_REPEATS) / 1e9

        bf16 = tera_bytes_per_s(x, gemv._weights_beyond_cache(dense), gemv._triton)
        tuned = rate()
        chosen = gemv._tuned_gemv_kernel.best_config
        ranked = sorted(((rate(c), c) for c in grid), key=lambda pair: -pair[0])
        best = ", ".join(f"{r:.2f} {c.kwargs} w{c.num_warps}" for r, c in ranked[:3])
        print(f"{name:<18}{bf16:>10.2f}{tuned:>10.2f}  {chosen}; {best}")


FEW_ROWS_LAUNCHES = [
    fp8_matmul.FewRowsLaunch(n, k, warps, stages, splits=1)
    for n, k, warps, stages in [(32, 256, 4, 4), (64, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 4), (16, 512, 4, 4)]
    + [(64, 256, 8, 4), (128, 128, 4, 4)]
] + [  # the reduction split over 2 to 8 programs a column block
    fp8_matmul.FewRowsLaunch(n, k, 4, stages, splits)
    for n, k, stages in [(32, 512, 3), (32, 256, 4), (16, 512, 4)]
    for splits in (2, 4, 8)
]


def float8_few_rows(shapes: dict[str, tuple[int, int]]) -> None:
    """Steps of 2 to 16 rows: the few-rows kernel's launches against cuBLASLt's float8 matmul
    (rows quantized per token first, what such steps took before) and bf16 cuBLAS, as
    microseconds a call."""
    print(
        f"{'layer':<18}{'rows':>5}{'bf16 cuBLAS':>12}{'fp8 cuBLASLt':>13}{'unsplit':>10}{'default':>9}{'best':>7}"
        "  best launch (us a call)"
    )
    for name, (n, k) in shapes.items():
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        packed = quantize_fp8(dense)
        copies, scales = gemv._weights_beyond_cache(packed.values), packed.scales
        for rows in (2, 4, 8, 16):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def micros(run, weights=copies, x=x):
                return 1e3 * gemv._milliseconds(x, weights, run) / gemv.TIMING_REPEATS

            def cublaslt(x, w, scales=scales):
                quantized, row_scales = fp8_matmul.quantize_rows(x)
                return torch._scaled_mm(
                    quantized, w.t(), scale_a=row_scales, scale_b=scales.view(1, -1), out_dtype=torch.bfloat16
                )

            def few_rows(launch, scales=scales):
                return lambda inputs, w: fp8_matmul.few_rows_linear(inputs, w, scales, launch)

            bf16 = micros(torch.nn.functional.linear, gemv._weights_beyond_cache(dense))
            timed = [(micros(few_rows(c)), c) for c in FEW_ROWS_LAUNCHES]
            best, launch = min(timed, key=lambda pair: pair[0])
            unsplit = min(t for t, c in timed if c.splits == 1)
            default = micros(few_rows(None))
            print(
                f"{name:<18}{rows:>5}{bf16:>12.1f}{micros(cublaslt):>13.1f}{unsplit:>10.1f}{default:>9.1f}{best:>7.1f}"
                f"  {launch}"
            )


def fused_matvecs() -> None:
    """TB/s of weight read by each fused matvec and by the pair of kernels it replaces."""
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(1, 64, device="cuda").repeat(1, 2)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    def qkv_separate(x, w):
        out = gemv.gemv(x, w)
        return fused.rotary_(out[:, : 40 * 128].view(1, 40, 128), cos, sin)

    cases = {
        "qkv_proj": (
            SHAPES["qkv_proj"],
            lambda x, w: gemv.gemv_rotary(x, w, None, ops.HeadRotation(cos, sin, 40, 128)),
            qkv_separate,
        ),
        "gate_up_proj": (
            SHAPES["gate_up_proj"],
            gemv.gemv_silu_and_mul,
            lambda x, w: fused.silu_and_mul(gemv.gemv(x, w)),
        ),
    }
    print(f"{'fused matvec':<14}{'dependent':>10}{'fused TB/s':>12}{'separate TB/s':>15}")
    for switch in ("1", "0"):
        os.environ[dependent_launch.ENV_SWITCH] = switch
        dependent_launch.dependent_launch.cache_clear()
        for name, ((n, k), fused_matvec, separate) in cases.items():
            weights = gemv._weights_beyond_cache(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64)
            together = tera_bytes_per_s(x, weights, fused_matvec)
            apart = tera_bytes_per_s(x, weights, separate)
            print(f"{name:<14}{switch:>10}{together:>12.2f}{apart:>15.2f}")
    os.environ.pop(dependent_launch.ENV_SWITCH)
    dependent_launch.dependent_launch.cache_clear()


if __name__ == "__main__":
    main()
