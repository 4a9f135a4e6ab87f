"""The Triton decode kernel with its keys split across programs (flash-decoding) gives the
same attention as unsplit, for any number of splits, including splits left empty."""

from __future__ import annotations

import pytest
import torch

from kestrel.core.attention.base import AttentionLayerSpec
from kestrel.core.attention.triton_paged import TritonPagedBackend, decode_attention, decode_splits
from kestrel.core.batch import BatchLayout, SequenceChunk
from kestrel.core.state import KVCacheSpec, PagedKVProvider
from kestrel.core.workspace import Workspace
from tests.core.test_contracts import backend_devices, dense_reference

DEVICES = backend_devices(TritonPagedBackend)
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")


# whole_blocks: every block masked, or the whole ones not; sinks: counted once, by the first split.
SPLIT_CASES = [
    (splits, window, None, whole, False) for splits in (1, 2, 5, 16) for window in (None, 50) for whole in (False, True)
] + [
    (1, None, None, False, True),
    (5, None, None, True, True),
    (16, 50, None, False, True),
    (1, None, 64, False, False),
]
SPLIT_CASES += [(5, None, 64, True, True)]


@pytest.mark.parametrize("num_splits, window, chunk, whole_blocks, with_sinks", SPLIT_CASES)
def test_split_decode_matches_dense_attention(num_splits, window, chunk, whole_blocks, with_sinks):
    torch.manual_seed(0)
    device = torch.device(DEVICES[0])
    heads, kv_heads, dim, page_size = 8, 2, 64, 16
    layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window, sinks=with_sinks, chunk_size=chunk)
    sinks = torch.randn(heads) * 3 if with_sinks else None
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32, page_size=page_size)
    kv = PagedKVProvider(spec, 64 * spec.bytes_per_page(), device)
    backend = TritonPagedBackend(device, page_size)
    lengths = [300, 5, 129]  # context lengths, the new token included
    contexts = [(torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for n in lengths]
    chunks = []
    for index, (length, (keys, values)) in enumerate(zip(lengths, contexts)):
        pages = tuple(kv.reserve(str(index), length))
        prefill = BatchLayout((SequenceChunk(length, 0, pages),), 0, page_size)
        metadata = backend.bind(prefill)
        backend.store(kv.layer(0), keys.to(device), values.to(device), metadata.slot_mapping)
        chunks.append(SequenceChunk(1, length - 1, pages))
    decode = backend.bind(BatchLayout(tuple(chunks), num_decodes=len(chunks), page_size=page_size)).decode
    query = torch.randn(len(lengths), heads, dim)
    output = torch.empty_like(query).to(device)
    decode_attention(
        query.to(device),
        kv.layer(0),
        decode,
        layer,
        output,
        num_splits=num_splits,
        WHOLE_BLOCKS=whole_blocks,
        sinks=None if sinks is None else sinks.to(device),
    )
    for row, (length, (keys, values)) in enumerate(zip(lengths, contexts)):
        expected = dense_reference(query[row : row + 1], keys, values, length - 1, layer.scale, window, sinks, chunk)
        torch.testing.assert_close(output[row : row + 1].cpu(), expected, atol=1e-5, rtol=1e-5)


def test_small_batches_split_and_large_ones_do_not():
    cpu = torch.device("cpu")
    assert decode_splits(1, 1, cpu) > 1
    assert decode_splits(256, 8, cpu) == 1
    assert decode_splits(1, 8, cpu) <= decode_splits(1, 1, cpu)


FLOAT8 = torch.float8_e4m3fn
# bfloat16 where it runs compiled: Triton's interpreter handles it unreliably.
QUERY_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICES[:1] == ["cuda"] else [])


@pytest.mark.parametrize(
    "heads, num_splits, window, dim, page_size",
    [
        (8, 1, None, 64, 16),
        (8, 3, 50, 64, 16),
        (4, 1, None, 64, 16),
        (16, 2, None, 64, 16),
        (8, 1, None, 128, 64),
        (2, 1, None, 64, 16),
    ],
)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("whole_blocks", [False, True])
def test_decode_over_a_float8_pool_matches_dense_attention(
    heads, num_splits, window, dim, page_size, dtype, whole_blocks
):
    """A float8 pool (values slot-minor, read by whole pages, widened to float16 for the
    dots) gives the dense attention over the rounded context within half-precision
    tolerance, for head groups of 1, 2, 4 and 8, split or not, never showing stale slots."""
    torch.manual_seed(0)
    device = torch.device(DEVICES[0])
    kv_heads = 2
    layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=FLOAT8, page_size=page_size)
    kv = PagedKVProvider(spec, 64 * spec.bytes_per_page(), device)
    for pages in (kv.layer(0).key, kv.layer(0).value):
        pages.view(torch.uint8).fill_(0x7E)  # stale slots: 448, which no output may show
    backend = TritonPagedBackend(device, page_size)
    lengths = [300, 5, 129]
    contexts = [[(torch.randn(n, kv_heads, dim) * 3).to(FLOAT8).float() for _ in range(2)] for n in lengths]
    chunks = []
    for index, (length, (keys, values)) in enumerate(zip(lengths, contexts)):
        pages = tuple(kv.reserve(str(index), length))
        metadata = backend.bind(BatchLayout((SequenceChunk(length, 0, pages),), 0, page_size))
        backend.store(kv.layer(0), keys.to(device, dtype), values.to(device, dtype), metadata.slot_mapping)
        chunks.append(SequenceChunk(1, length - 1, pages))
    decode = backend.bind(BatchLayout(tuple(chunks), num_decodes=len(chunks), page_size=page_size)).decode
    query = torch.randn(len(lengths), heads, dim, dtype=dtype)
    output = torch.empty_like(query).to(device)
    decode_attention(
        query.to(device), kv.layer(0), decode, layer, output, num_splits=num_splits, WHOLE_BLOCKS=whole_blocks
    )
    for row, (length, (keys, values)) in enumerate(zip(lengths, contexts)):
        expected = dense_reference(query[row : row + 1].float(), keys, values, length - 1, layer.scale, window)
        torch.testing.assert_close(output[row : row + 1].float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_split_partials_come_from_the_workspace_the_backend_allocated():
    """`allocate` reserves the partials once; a split decode through them gives the same
    output as one that allocates them itself, and allocates nothing new per call."""
    torch.manual_seed(0)
    device = torch.device(DEVICES[0])
    heads, kv_heads, dim, page_size, length = 4, 1, 64, 16, 200
    layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32, page_size=page_size)
    kv = PagedKVProvider(spec, 32 * spec.bytes_per_page(), device)
    backend = TritonPagedBackend(device, page_size)
    workspace = Workspace(device)
    backend.allocate(workspace, max_rows=2, layer=layer)
    assert decode_splits(1, kv_heads, device) > 1  # the case below does split
    pages = tuple(kv.reserve("a", length))
    slots = backend.bind(BatchLayout((SequenceChunk(length, 0, pages),), 0, page_size)).slot_mapping
    backend.store(kv.layer(0), *(torch.randn(length, kv_heads, dim, device=device) for _ in range(2)), slots)
    decode = backend.bind(BatchLayout((SequenceChunk(1, length - 1, pages),), 1, page_size)).decode
    query = torch.randn(1, heads, dim, device=device)
    through_workspace, allocated = torch.empty_like(query), torch.empty_like(query)
    backend.decode(query, query, query, kv.layer(0), decode, layer, through_workspace)
    decode_attention(query, kv.layer(0), decode, layer, allocated)
    torch.testing.assert_close(through_workspace, allocated)
    partials = workspace.get("attention.decode.partial_lse", (1,), torch.float32)
    assert partials.abs().sum() > 0  # the split wrote its partials there


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("dims", [(32, 16), (512, 64)])  # a small latent, and DeepSeek's
def test_latent_decode_matches_dense_attention_for_any_split(num_splits, dims):
    from kestrel.core.attention.triton_mla import TritonMlaBackend, mla_decode_attention

    torch.manual_seed(0)
    device = torch.device(DEVICES[0])
    (latent, rope), heads, page_size = dims, 18, 16
    dim = latent + rope
    layer = AttentionLayerSpec(heads, 1, dim, 0.1, latent_dim=latent)
    spec = KVCacheSpec(1, 1, dim, torch.float32, page_size, latent_dim=latent)
    kv = PagedKVProvider(spec, 32 * spec.bytes_per_page(), device)
    backend = TritonMlaBackend(device, page_size)
    lengths = [130, 3, 47]
    contexts = [torch.randn(n, 1, dim) for n in lengths]
    chunks = []
    for index, (length, keys) in enumerate(zip(lengths, contexts)):
        pages = tuple(kv.reserve(str(index), length))
        metadata = backend.bind(BatchLayout((SequenceChunk(length, 0, pages),), 0, page_size))
        backend.store(kv.layer(0), keys.to(device), keys[..., :latent].to(device), metadata.slot_mapping)
        chunks.append(SequenceChunk(1, length - 1, pages))
    decode = backend.bind(BatchLayout(tuple(chunks), num_decodes=len(chunks), page_size=page_size)).decode
    query = torch.randn(len(lengths), heads, dim)
    output = torch.empty(len(lengths), heads, latent, device=device)
    mla_decode_attention(query.to(device), kv.layer(0), decode, layer, output, num_splits=num_splits)
    for row, (length, keys) in enumerate(zip(lengths, contexts)):
        expected = dense_reference(query[row : row + 1], keys, keys[..., :latent], length - 1, layer.scale, None)
        torch.testing.assert_close(output[row : row + 1].cpu(), expected, atol=1e-5, rtol=1e-5)
