"""State lent between processes through CUDA IPC (core/cuda_ipc.py): the packing on any
device, and, on a GPU, a real second process that lends its state to this one."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from kestrel.core import cuda_ipc
from kestrel.core.transfer import TransferHandle


def _handle(device: str) -> TransferHandle:
    """Tensors of several dtypes and odd sizes, as KV pages and recurrent slots would be."""
    generator = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 3, 5, 4, 7, generator=generator).to(torch.bfloat16)
    conv = torch.randn(3, 11, generator=generator)
    codes = torch.randint(0, 255, (13,), dtype=torch.uint8, generator=generator)
    state = {"kv": [kv.to(device)], "recurrent": [conv.to(device), codes.to(device)]}
    return TransferHandle("prefill-7", 37, str(device), state)


def test_packed_state_reads_back_tensor_for_tensor():
    handle = _handle("cpu")
    buffer, layout = cuda_ipc._pack(handle)
    for name, tensors in handle.state.items():
        for tensor, entry in zip(tensors, layout[name], strict=True):
            assert entry["offset"] % cuda_ipc.ALIGNMENT == 0
            assert torch.equal(cuda_ipc._view(buffer, entry), tensor)


def test_a_description_naming_what_it_cannot_hold_is_refused():
    buffer, layout = cuda_ipc._pack(_handle("cpu"))
    entry = layout["kv"][0]
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        cuda_ipc._view(buffer, {**entry, "dtype": "Tensor"})
    with pytest.raises(ValueError, match="bytes"):
        cuda_ipc._view(buffer, {**entry, "offset": buffer.numel() - 8})


def test_bytes_are_told_apart_from_a_description():
    assert cuda_ipc.is_shared_state(json.dumps({"kind": cuda_ipc.KIND}).encode())
    assert not cuda_ipc.is_shared_state(b"PK\x03\x04 torch.save's zip")
    assert not cuda_ipc.is_shared_state(b"{not json")
    assert not cuda_ipc.is_shared_state(b"[1, 2]")


def test_an_instance_without_a_gpu_says_what_to_do_instead():
    description = json.dumps({"kind": cuda_ipc.KIND}).encode()
    with pytest.raises(ValueError, match="--kv-buffer-device cpu"):
        cuda_ipc.open_shared_state(description, torch.device("cpu"))


def _lend(connection) -> None:
    """A second process: export state on the GPU, lend it, free it when told to."""
    shared = cuda_ipc.SharedExports()
    connection.send(shared.share("prefill-7", _handle("cuda")))
    connection.recv()  # copied
    connection.send((shared.release("prefill-7"), shared.num_bytes))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_another_process_lends_its_state_and_gets_it_back():
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    lender = context.Process(target=_lend, args=(theirs,))
    lender.start()
    try:
        assert ours.poll(120), "the lending process did not answer"
        description = ours.recv()
        assert len(description) < 4096  # the state stayed on the GPU; only where it lies travelled
        handle = cuda_ipc.open_shared_state(description, torch.device("cuda"))
        ours.send("copied")
        released, held_bytes = ours.recv()
        assert released and held_bytes == 0
        expected = _handle("cpu")
        assert (handle.request_id, handle.num_tokens) == ("prefill-7", 37)
        for name, tensors in expected.state.items():
            for got, want in zip(handle.state[name], tensors, strict=True):
                assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
        with pytest.raises(ValueError, match="could not map"):
            cuda_ipc.open_shared_state(json.dumps({"kind": cuda_ipc.KIND}).encode(), torch.device("cuda"))
    finally:
        lender.join(30)
        if lender.is_alive():
            lender.kill()
