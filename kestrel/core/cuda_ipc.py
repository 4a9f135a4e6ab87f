"""State handed between processes on one host through CUDA IPC, without leaving the GPU.

A prefill instance started with `--kv-buffer-device cuda` exports a finished prompt's state to
device memory (`StateCopy` with a CUDA place). `SharedExports` packs it into one byte buffer,
keeps that buffer alive and describes it: the buffer's CUDA IPC handle, the GPU's UUID and
each tensor's dtype, shape and offset, as JSON (never pickled: the description crosses HTTP).
The decode instance's core process maps the buffer (`open_shared_state`), copies it into its
own memory in one device-to-device copy, unmaps it, and imports the copy like any handle.

Ownership: the prefill side owns each buffer until `release` (the decode instance says it has
copied it, or the transfer expires); a buffer released before the decode side mapped it stays
allocated until it is unmapped there too (torch's IPC reference count), so a slow consumer
never reads freed memory. The decode side owns its copy, as it owns any imported state.
"""

from __future__ import annotations

import base64
import json
import time

import torch

from kestrel.core.transfer import TransferHandle

KIND = "kestrel-cuda-ipc-state"
ALIGNMENT = 256  # bytes: every tensor of the packed buffer starts where any dtype's view may
# The front end releases every lent buffer (copied by its decode instance, or expired after
# --kv-transfer-timeout); this only bounds one whose release was lost (its requester left
# just as it finished).
UNRELEASED_SECONDS = 600.0


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    return offsets, end


def _pack(handle: TransferHandle) -> tuple[torch.Tensor, dict[str, list[dict]]]:
    """Every tensor of the handle in one device byte buffer, and where each lies in it."""
    tensors = [t for group in handle.state.values() for t in group]
    device = tensors[0].device if tensors else torch.device("cuda")
    offsets, size = _offsets(tensors)
    buffer = torch.empty(max(size, ALIGNMENT), dtype=torch.uint8, device=device)
    layout: dict[str, list[dict]] = {}
    position = iter(offsets)
    for name, group in handle.state.items():
        entries = layout.setdefault(name, [])
        for tensor in group:
            offset = next(position)
            data = tensor.contiguous().view(-1).view(torch.uint8)
            buffer[offset : offset + data.numel()].copy_(data)
            entries.append(
                {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "offset": offset}
            )
    return buffer, layout


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class SharedExports:
    """Exported states on this process's GPU, lent to other processes until released."""

    def __init__(self, max_age_seconds: float = UNRELEASED_SECONDS) -> None:
        self.max_age_seconds = max_age_seconds
        self._held: dict[str, tuple[torch.Tensor, float]] = {}  # export id -> packed buffer, deadline

    def share(self, export_id: str, handle: TransferHandle) -> bytes:
        """Keep the handle's state in one buffer under `export_id`; its description as bytes."""
        self._expire()
        buffer, layout = _pack(handle)
        # The GPU's index is left out: indices differ between processes, its UUID does not.
        _, ipc_handle, size, offset, counter, counter_offset, event, event_sync = (
            buffer.untyped_storage()._share_cuda_()
        )
        self._held[export_id] = (buffer, time.monotonic() + self.max_age_seconds)
        description = {
            "kind": KIND,
            "request_id": handle.request_id,
            "num_tokens": handle.num_tokens,
            "gpu_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
            "storage": {
                "handle": _b64(ipc_handle),
                "size": size,
                "offset": offset,
                "ref_counter": _b64(counter),
                "ref_counter_offset": counter_offset,
                "event": _b64(event) if event else None,
                "event_sync": bool(event_sync),
            },
            "num_bytes": buffer.numel(),
            "layout": layout,
        }
        return json.dumps(description).encode()

    def release(self, export_id: str) -> bool:
        """Drop the buffer; False where none was held under that id."""
        return self._held.pop(export_id, None) is not None

    def _expire(self) -> None:
        now = time.monotonic()
        for export_id in [key for key, (_, deadline) in self._held.items() if deadline <= now]:
            del self._held[export_id]

    @property
    def num_bytes(self) -> int:
        return sum(buffer.numel() for buffer, _ in self._held.values())


def is_shared_state(data: bytes) -> bool:
    """Whether `data` describes state lent through CUDA IPC (rather than holding it)."""
    if not data.startswith(b"{"):
        return False
    try:
        return json.loads(data).get("kind") == KIND
    except (ValueError, AttributeError):
        return False


def _local_index(gpu_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == gpu_uuid:
            return index
    raise ValueError(
        f"the prefill instance's state lies on GPU {gpu_uuid}, which this process cannot see "
        "(CUDA_VISIBLE_DEVICES); start the prefill instance with --kv-buffer-device cpu to send it over TCP"
    )


def _map(description: dict) -> torch.Tensor:
    """The producer's buffer, mapped into this process (a view of the other process's memory)."""
    storage = description["storage"]
    index = _local_index(description["gpu_uuid"])
    mapped = torch.UntypedStorage._new_shared_cuda(
        index,
        base64.b64decode(storage["handle"]),
        int(storage["size"]),
        int(storage["offset"]),
        base64.b64decode(storage["ref_counter"]),
        int(storage["ref_counter_offset"]),
        base64.b64decode(storage["event"]) if storage["event"] else b"",
        bool(storage["event_sync"]),
    )
    num_bytes = int(description["num_bytes"])
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(mapped, 0, (num_bytes,), (1,))


def open_shared_state(data: bytes, device: torch.device) -> TransferHandle:
    """Copy the state `data` describes onto `device` and unmap the producer's buffer; a
    ValueError saying what is wrong where the description is not one, or cannot be mapped."""
    if device.type != "cuda":
        raise ValueError(
            f"the prefill instance lends its state through CUDA IPC; this instance runs on {device}: "
            "start the prefill instance with --kv-buffer-device cpu"
        )
    try:
        description = json.loads(data)
        remote = _map(description)
        local = remote.to(device, copy=True)
        # The copy must be done before the mapping goes: the producer may free its buffer then.
        torch.cuda.current_stream(device).synchronize()
        del remote
        state = {
            str(name): [_view(local, entry) for entry in entries] for name, entries in description["layout"].items()
        }
        return TransferHandle(str(description["request_id"]), int(description["num_tokens"]), "cuda-ipc", state)
    except (KeyError, TypeError, AttributeError, RuntimeError) as error:  # malformed, or the mapping failed
        raise ValueError(f"could not map the prefill instance's state: {type(error).__name__}: {error}") from None


def _view(buffer: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the prefill instance's state names an unknown dtype {entry['dtype']!r}")
    shape = [int(size) for size in entry["shape"]]
    num_bytes = torch.Size(shape).numel() * dtype.itemsize
    offset = int(entry["offset"])
    if offset < 0 or offset + num_bytes > buffer.numel():
        raise ValueError(
            f"the prefill instance's state names bytes {offset}..{offset + num_bytes} of a {buffer.numel()}-byte buffer"
        )
    return buffer[offset : offset + num_bytes].view(dtype).view(shape)
