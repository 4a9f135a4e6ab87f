"""Time 4-bit one-row matvecs on the CPU: Kestrel's AVX-512 VNNI kernel against torch's.

The demo model's decoder shapes (SmolLM2-135M: 30 layers of qkv 960 x 576, o 576 x 576,
gate/up 3072 x 576, down 576 x 1536), every weight distinct so that none stays in cache, run
one after another as a decode step runs them. Prints ms per step and GB/s of 4-bit bytes.

    PYTHONPATH=. python scripts/int4_cpu_bench.py
"""

from __future__ import annotations

import argparse
import time

import torch

from kestrel.core.runtime import cpu_kernels
from kestrel.layers import int4_cpu
from kestrel.layers.quantized import Int4VnniWeight, Int4Weight, int4_groups, int4_linear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def weights(layers: int) -> tuple[list[Int4VnniWeight], list[Int4Weight]]:
    vnni, torch_packed = [], []
    for _ in range(layers):
        for out_features, in_features in SHAPES:
            codes, scale, zero = int4_groups(torch.randn(out_features, in_features) * 0.05, 32)
            codes = codes.reshape(out_features, in_features)
            packed_codes, scales_and_zeros = int4_cpu.pack(codes, scale, zero)
            vnni.append(Int4VnniWeight(packed_codes, scales_and_zeros, out_features, in_features))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            pairs = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
            torch_packed.append(Int4Weight(packed, pairs, out_features, in_features))
    return vnni, torch_packed


def time_step(step, repeats: int) -> float:
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of the two kernels")
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("this CPU does not run the AVX-512 VNNI kernel (or it could not be built)")
    vnni, torch_packed = weights(args.layers)
    inputs = {width: torch.randn(1, width) for width in {shape[1] for shape in SHAPES}}
    nbytes = sum(w.narrow_bytes for w in vnni)
    for _ in range(args.rounds):
        for name, packed in (("vnni", vnni), ("torch", torch_packed)):
            seconds = time_step(lambda p=packed: [int4_linear(inputs[w.in_features], w) for w in p], args.repeats)
            print(f"{name:6s} {seconds * 1e3:6.2f} ms a step  {nbytes / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
