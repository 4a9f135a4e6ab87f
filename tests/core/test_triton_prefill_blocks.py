"""The Triton prefill kernel over key blocks wholly visible to a query block (read without
masks) and the blocks at its diagonal or window edge (masked), for several block shapes:
the same attention as dense, after a cached prefix or none."""

from __future__ import annotations

import pytest
import torch

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.attention.triton_paged import TritonPagedBackend, prefill_attention
from kestrel.core.batch import BatchLayout, SequenceChunk
from kestrel.core.state import KVCacheSpec, PagedKVProvider
from tests.core.test_contracts import backend_devices, dense_reference

DEVICES = backend_devices(TritonPagedBackend)
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(
    "launch", [{}, {"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 64}]
)
def test_prefill_matches_dense_attention_across_whole_and_edge_blocks(window, launch):
    torch.manual_seed(0)
    device = torch.device(DEVICES[0])
    heads, kv_heads, dim, page_size = 4, 2, 32, 16
    layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32, page_size=page_size)
    kv = PagedKVProvider(spec, 64 * spec.bytes_per_page(), device)
    backend = TritonPagedBackend(device, page_size)
    shapes = [(37, 50), (0, 45), (64, 3)]  # (cached tokens, new tokens)
    contexts = [(torch.randn(c + n, kv_heads, dim), torch.randn(c + n, kv_heads, dim)) for c, n in shapes]
    chunks = []
    for index, ((cached, new), (keys, values)) in enumerate(zip(shapes, contexts)):
        pages = tuple(kv.reserve(str(index), cached + new))
        whole = backend.bind(BatchLayout((SequenceChunk(cached + new, 0, pages),), 0, page_size))
        backend.store(kv.layer(0), keys.to(device), values.to(device), whole.slot_mapping)
        chunks.append(SequenceChunk(new, cached, pages))
    meta = backend.bind(BatchLayout(tuple(chunks), 0, page_size)).prefill
    query = torch.randn(sum(new for _, new in shapes), heads, dim)
    output = torch.empty_like(query).to(device)
    prefill_attention(query.to(device), kv.layer(0), meta, layer, output, **launch)
    start = 0
    for (cached, new), (keys, values) in zip(shapes, contexts):
        expected = dense_reference(query[start : start + new], keys, values, cached, layer.scale, window)
        torch.testing.assert_close(output[start : start + new].cpu(), expected, atol=1e-4, rtol=1e-4)
        start += new
