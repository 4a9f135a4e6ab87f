"""The CUDA runtime: one GPU, NCCL collectives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kestrel.core.runtime.base import DeviceRuntime, HostTransfer, MemoryInfo, Outputs


class _CudaHostTransfer(HostTransfer):
    """Copies into pinned host memory on the current stream, and an event marking their end."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for target, source in zip(host, tensors):
            target.copy_(source, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        super().__init__(host)

    def wait(self) -> list[torch.Tensor]:
        self._done.synchronize()
        return super().wait()


MIN_WARM_UP_PREFILL = 16  # smaller steps take launches the decode graphs compiled when captured


class CudaRuntime(DeviceRuntime):
    name = "cuda"
    supports_graphs = True
    graphs_by_default = True

    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but no CUDA device is available")
        self._device = torch.device("cuda", index)
        self._graph_pool: tuple[int, int] | None = None  # shared by every captured graph

    @property
    def device(self) -> torch.device:
        return self._device

    def configure_process(self) -> None:
        # Triton launches on the current device and NCCL binds its communicator to it: make
        # it this runtime's GPU (a tensor-parallel rank's, or the one --device names).
        torch.cuda.set_device(self._device)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self._device)
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def distributed_backend(self) -> str:
        return "nccl"

    def warm_up_smaller_prefills(self, num_tokens: int) -> list[int]:
        """Halving down to MIN_WARM_UP_PREFILL tokens, then one step of an odd size. Triton
        compiles a kernel once per launch shape, and some layers choose theirs by a step's size
        (the fused MoE's launch table, by rows per expert, each entry spanning more than a
        factor of two), so these steps compile every launch a real step may take before the
        first request, not during one (a stall of a second or more each). The odd size is for
        kernels that specialise on whether a token count divides by 16 (flash-linear-attention's
        chunked prefill, where installed): real steps rarely do."""
        sizes, size = [], num_tokens // 2
        while size >= MIN_WARM_UP_PREFILL:
            sizes.append(size)
            size //= 2
        odd = num_tokens // 2 - 1
        return sizes + ([odd] if odd >= MIN_WARM_UP_PREFILL else [])

    def to_host_async(self, tensors: Sequence[torch.Tensor]) -> HostTransfer:
        return _CudaHostTransfer(tensors)

    def capture_step(self, forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
        """A CUDA graph of `forward`, in one memory pool shared with the runtime's other graphs
        (capture the largest first, so the smaller ones fit in its memory)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # warm-up: compiles kernels, settles the allocator
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = forward()
        torch.cuda.synchronize(self._device)

        def replay() -> Outputs:
            graph.replay()
            return outputs

        return replay

    def peak_bytes_during(self, run: Callable[[], None]) -> int:
        self.synchronize()
        before = torch.cuda.memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        run()
        self.synchronize()
        peak = torch.cuda.max_memory_allocated(self._device) - before
        torch.cuda.empty_cache()  # hand the run's cached blocks back, so memory_info sees them free
        return peak
