"""All-reduce bandwidth between the ranks of one host, the collective tensor parallelism
runs twice per layer: NCCL on GPUs (one rank per GPU), gloo on the CPU.

    python scripts/allreduce_bench.py --world-size 2

Reports, per message size, the time of one all-reduce and its bus bandwidth
(2 x (n - 1) / n x bytes / time, the convention of nccl-tests), so the figure is
comparable across rank counts.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kestrel.distributed.group import GroupAddress

SIZES_MB = (0.0625, 1, 16, 64, 256)
REPEATS = 20


def measure(rank: int, world_size: int, address: GroupAddress, results) -> None:
    use_cuda = torch.cuda.device_count() >= world_size
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=address.init_method,
        rank=rank,
        world_size=world_size,
    )
    rows = []
    for size_mb in SIZES_MB:
        x = torch.ones(int(size_mb * 2**20) // 2, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        if use_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(REPEATS):
            dist.all_reduce(x)
        if use_cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / REPEATS
        bus = 2 * (world_size - 1) / world_size * x.numel() * 2 / seconds / 1e9
        rows.append({"size_mb": size_mb, "us": seconds * 1e6, "bus_gb_s": bus})
    if rank == 0:
        results.put({"backend": dist.get_backend(), "world_size": world_size, "rows": rows})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    address = GroupAddress.on_this_host(args.world_size)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=measure, args=(rank, args.world_size, address, results))
        for rank in range(args.world_size)
    ]
    for process in processes:
        process.start()
    report = results.get(timeout=300)
    for process in processes:
        process.join()
    print(f"{report['backend']}, {report['world_size']} ranks")
    for row in report["rows"]:
        print(f"{row['size_mb']:>9} MB  {row['us']:>10.1f} us  {row['bus_gb_s']:>8.1f} GB/s bus")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
