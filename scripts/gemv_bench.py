"""One-row linears on the GPU: cuBLAS against the Triton matvec (layers/gemv.py), per
Llama-3-8B weight shape, as bytes read per second; and which one `ops.linear` keeps.

    python scripts/gemv_bench.py
"""

from __future__ import annotations

import torch

from kestrel.layers import gemv

SHAPES = {  # name: (out_features, in_features), Llama-3-8B
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}


def main() -> None:
    print(f"{'layer':<14}{'cuBLAS TB/s':>12}{'Triton TB/s':>12}  kept")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bytes_read = weight.numel() * weight.element_size()
        weights = gemv._weights_beyond_cache(weight)
        ms_cublas = gemv._milliseconds(x, weights, gemv._cublas) / gemv.TIMING_REPEATS
        ms_triton = gemv._milliseconds(x, weights, gemv.gemv) / gemv.TIMING_REPEATS
        kept = "triton" if gemv.prefers_gemv(x, weight) else "cublas"
        print(f"{name:<14}{bytes_read / ms_cublas / 1e9:>12.2f}{bytes_read / ms_triton / 1e9:>12.2f}  {kept}")


if __name__ == "__main__":
    main()
