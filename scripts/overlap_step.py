"""Whether a decode step of many rows runs faster as two half-batches on two streams, a layer's
attention of one half beside the matmuls of the other, than as one batch: the real model
(dummy weights), the real kernels, each variant captured in one CUDA graph and replayed.

    python scripts/overlap_step.py --dummy-config llama-3-8b --quantization fp8 --batch 512

Each half runs the model's own forward in a thread of its own, on a stream of its own. The
halves take turns at two kinds of segment, strictly alternating between them on the device:
attention calls (`ForwardContext.attend`) and everything between two of them (projections,
MLP or experts, norms; the embedding before the first, the LM head after the last). So
half B's attention of a layer runs beside half A's projections and MLP, and the other way
round, and no two segments of one kind ever run at once (they may share scratch buffers).
The device order is fixed by events between the streams; the threads only make sure each
event is recorded before the other stream waits on it.

Printed: the full batch, the two halves one after the other on one stream, and the two
halves on two streams (ms per step), and how far the halves' logits are from the full
batch's. On the CPU (`--device cpu`, a tiny shape) only the logits are compared: the turn
taking is checked, not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kestrel import LLM
from kestrel.core.batch import KV_GROUP, BatchLayout, SequenceChunk
from kestrel.core.forward import ForwardContext, bind_groups

ATTENTION, BETWEEN = "attention", "between"


class TurnRing:
    """Segments of one kind from halves 0 and 1, alternating on the device: half h's n-th
    segment is the ring's (2n + h)-th and waits on the device for the one before it to end."""

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self.ends: dict[int, torch.cuda.Event | None] = {}
        self.entered = [0, 0]
        self.current = [-1, -1]
        self.changed = threading.Condition()

    def enter(self, half: int) -> None:
        index = 2 * self.entered[half] + half
        self.entered[half] += 1
        self.current[half] = index
        if index == 0:
            return
        with self.changed:
            # A half that failed ends no more segments: the other gives up rather than hang.
            if not self.changed.wait_for(lambda: index - 1 in self.ends, timeout=120):
                raise TimeoutError(f"segment {index - 1} never ended (did the other half fail?)")
            event = self.ends[index - 1]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def end(self, half: int) -> None:
        event = None
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
        with self.changed:
            self.ends[self.current[half]] = event
            self.changed.notify_all()


@dataclass
class TurnTaking:
    on_cuda: bool
    rings: dict[str, TurnRing] = field(init=False)

    def __post_init__(self) -> None:
        self.rings = {kind: TurnRing(self.on_cuda) for kind in (ATTENTION, BETWEEN)}

    def switch(self, half: int, leaving: str, entering: str) -> None:
        self.rings[leaving].end(half)
        self.rings[entering].enter(half)


@dataclass(frozen=True)
class TurnTakingContext(ForwardContext):
    """A half's forward context: each attention call is a turn of its own."""

    turns: TurnTaking | None = None
    half: int = 0

    def attend(self, *args, **kwargs) -> torch.Tensor:
        self.turns.switch(self.half, BETWEEN, ATTENTION)
        output = super().attend(*args, **kwargs)
        self.turns.switch(self.half, ATTENTION, BETWEEN)
        return output


def batch_layout(parts, rows: range, context: int) -> BatchLayout:
    """Decode rows at `context`, each over pages of its own (garbage KV, real reads)."""
    page_size = parts.kv.spec.page_size
    pages_per_seq = -(-context // page_size)
    capacity = parts.kv.total_capacity() - 1
    chunks = tuple(
        SequenceChunk(1, context - 1, tuple((row * pages_per_seq + page) % capacity for page in range(pages_per_seq)))
        for row in rows
    )
    return BatchLayout(chunks, len(chunks), page_size)


def forward(model, ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
    return model.compute_logits(model(ids, positions, context))


def halves_on_two_streams(model, halves, streams) -> list[torch.Tensor]:
    """Both halves' logits, each half's forward in a thread on its own stream, taking turns."""
    on_cuda = streams[0] is not None
    turns = TurnTaking(on_cuda)
    results: list[torch.Tensor | BaseException | None] = [None, None]
    if on_cuda:
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())

    def run(half: int) -> None:
        ids, positions, metadata = halves[half]
        context = TurnTakingContext(metadata.groups, turns, half)
        try:
            with torch.inference_mode(), torch.cuda.stream(streams[half]) if on_cuda else contextlib.nullcontext():
                turns.rings[BETWEEN].enter(half)
                results[half] = forward(model, ids, positions, context)
                turns.rings[BETWEEN].end(half)
        except BaseException as error:  # re-raised by the caller's thread
            results[half] = error

    threads = [threading.Thread(target=run, args=(half,)) for half in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if on_cuda:
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
    return results


def graph_ms(call: Callable[[], object], repeats: int = 20) -> tuple[float, object]:
    """Device ms per replay of `call` captured in a CUDA graph, and its output."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = call()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, output


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dummy-config", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=40)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500)
    args = parser.parse_args()
    llm = LLM(
        args.dummy_config,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=4096,
        max_num_seqs=args.batch,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        enforce_eager=True,
    )
    parts = llm.engine.parts
    if set(parts.groups) != {KV_GROUP}:
        raise SystemExit(f"{args.dummy_config}: only models whose one state group is the KV pool are split here")
    model, device = parts.runner.model, parts.runtime.device
    half = args.batch // 2
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, parts.spec.vocab_size, (args.batch,), generator=generator).to(device)
    positions = torch.full((args.batch,), args.context - 1, dtype=torch.long, device=device)

    def bound(rows: range) -> ForwardContext:
        layout = batch_layout(parts, rows, args.context)
        return bind_groups(parts.groups, lambda binder: binder.bind(layout))

    full_context = bound(range(args.batch))
    halves = [
        (ids[:half], positions[:half], bound(range(half))),
        (ids[half:], positions[half:], bound(range(half, args.batch))),
    ]
    on_cuda = device.type == "cuda"
    streams = [torch.cuda.Stream(), torch.cuda.Stream()] if on_cuda else [None, None]

    def full() -> torch.Tensor:
        with torch.inference_mode():
            return forward(model, ids, positions, full_context)

    def one_stream() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [forward(model, *halves[h][:2], halves[h][2]) for h in (0, 1)]

    def two_streams() -> list[torch.Tensor]:
        return halves_on_two_streams(model, halves, streams)

    shape = f"{args.dummy_config} {args.quantization or args.dtype}, KV {args.kv_cache_dtype}"
    print(f"{shape}, {args.batch} rows at {args.context} tokens, halves of {half}")
    if not on_cuda:
        reference = full()
        for name, variant in (("one stream", one_stream), ("two threads", two_streams)):
            difference = (torch.cat(variant()) - reference).abs().max().item()
            print(f"{name}: max |logits - full batch's| {difference:.2e}")
        return
    full_ms, reference = graph_ms(full)
    print(f"full batch:                 {full_ms:8.3f} ms")
    for name, variant in (("halves, one stream", one_stream), ("halves, two streams", two_streams)):
        ms, logits = graph_ms(variant)
        logits = torch.cat(logits)
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        difference = (logits - reference).abs().max().item()
        print(
            f"{name + ':':<28}{ms:8.3f} ms ({full_ms / ms:.3f}x the full batch's speed); "
            f"max |logits diff| {difference:.3f}, argmax agreement {agree:.4f}"
        )


if __name__ == "__main__":
    main()
