"""One contract suite that every attention backend, runtime and recipe passes."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from kestrel.core.attention.base import LATENT_KV, SEPARATE_KV, AttentionLayerSpec, BackendRequirements
from kestrel.core.attention.registry import BACKENDS, NoAttentionBackendError, select_backend
from kestrel.core.batch import BatchLayout, SequenceChunk
from kestrel.core.graph import GraphPhase
from kestrel.core.runtime import create_runtime
from kestrel.core.state import KVCacheSpec, PagedKVProvider
from kestrel.core.weight_bindings import WeightBindingError
from kestrel.models.registry import UnsupportedArchitectureError, recipe_for, supported_architectures
from kestrel.weights.loader import build_empty
from tests.checkpoints import FAMILIES

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# ---- runtimes ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_runtime_contract(device):
    runtime = create_runtime(device)
    assert runtime.device.type == device
    assert runtime.default_dtype() in runtime.supported_dtypes()
    memory = runtime.memory_info()
    assert 0 < memory.free_bytes <= memory.total_bytes
    assert runtime.distributed_backend() in ("gloo", "nccl")
    runtime.synchronize()


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        create_runtime("tpu")


# ---- attention backends --------------------------------------------------------------------


def dense_reference(q, k_all, v_all, cached, scale, window, sinks=None, chunk=None):
    """Plain causal attention of `q` (positions cached..) over the full context, GQA expanded;
    `sinks` [heads]: one more logit per head in each softmax, with no value; `chunk`: each
    query sees only the keys of its own chunk of positions."""
    heads, kv_heads = q.shape[1], k_all.shape[1]
    k_all = k_all.repeat_interleave(heads // kv_heads, dim=1)
    v_all = v_all.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k_all.double()) * scale
    q_pos = torch.arange(cached, cached + q.shape[0])[:, None]
    k_pos = torch.arange(k_all.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    if chunk is not None:
        allowed &= k_pos >= q_pos // chunk * chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        weights = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v_all.double()).float()


def backend_devices(backend) -> list[str]:
    """Where a backend is tested: its devices here, or the CPU under Triton's interpreter."""
    devices = [d for d in DEVICES if d in backend.capabilities.devices]
    if not devices and os.environ.get("TRITON_INTERPRET") == "1":
        devices = ["cpu"]
    return devices


def supported(values, allowed) -> list:
    return [v for v in values if allowed is None or v in allowed]


BACKEND_CASES = [
    (backend, device, page_size, dim, heads, kv_heads, window)
    for backend in BACKENDS
    if SEPARATE_KV in backend.capabilities.kv_forms
    for device in backend_devices(backend)
    for page_size in supported((4, 16, 64), backend.capabilities.page_sizes)
    for dim in supported((16, 64, 128), backend.capabilities.head_dims)
    for heads, kv_heads in ((4, 4), (8, 2), (4, 1))
    for window in (None, 5)
]


# GPT-OSS's sinks (with and without a window) and Llama 4's chunks, where a backend has them.
MASK_CASES = [
    (backend, device, page_size, window, sinks, chunk)
    for backend in BACKENDS
    if SEPARATE_KV in backend.capabilities.kv_forms
    for device in backend_devices(backend)
    for page_size in supported((4, 16), backend.capabilities.page_sizes)
    for window, sinks, chunk in ((None, True, None), (5, True, None), (None, False, 8), (None, True, 16))
    if (not sinks or backend.capabilities.sinks) and (chunk is None or backend.capabilities.chunked_attention)
]


@pytest.mark.parametrize("backend_cls, device, page_size, window, sinks, chunk", MASK_CASES)
def test_backend_with_sinks_or_chunks_matches_dense_reference(backend_cls, device, page_size, window, sinks, chunk):
    layer = AttentionLayerSpec(8, 2, 64, 64**-0.5, window, sinks=sinks, chunk_size=chunk)
    head_sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2 if sinks else None
    run_mixed_batch(backend_cls, device, page_size, layer, head_sinks)


@pytest.mark.parametrize("backend_cls, device, page_size, dim, heads, kv_heads, window", BACKEND_CASES)
def test_backend_matches_dense_reference_on_a_mixed_batch(backend_cls, device, page_size, dim, heads, kv_heads, window):
    run_mixed_batch(backend_cls, device, page_size, AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window))


def run_mixed_batch(backend_cls, device, page_size, layer, sinks=None):
    torch.manual_seed(0)
    heads, kv_heads, dim, window = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.sliding_window
    extra = {} if sinks is None else {"sinks": sinks.to(device)}
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32, page_size=page_size)
    kv = PagedKVProvider(spec, 64 * spec.bytes_per_page(), torch.device(device))
    backend = backend_cls(torch.device(device), page_size)
    # (cached tokens, new tokens): three decodes, a fresh prefill, prefills after a cached
    # prefix, one longer than a query block and spread over several pages.
    shapes = [(9, 1), (0, 1), (40, 1), (0, 7), (13, 6), (3, 70)]
    contexts = {
        i: (torch.randn(c + n, kv_heads, dim), torch.randn(c + n, kv_heads, dim)) for i, (c, n) in enumerate(shapes)
    }
    chunks = []
    for index, (cached, new) in enumerate(shapes):
        pages = tuple(kv.reserve(str(index), cached + new))
        if cached:  # put the cached prefix in place with a prefill-only step first
            prefix = BatchLayout((SequenceChunk(cached, 0, pages),), 0, page_size)
            k, v = contexts[index][0][:cached], contexts[index][1][:cached]
            q = torch.randn(cached, heads, dim)
            backend.forward(q.to(device), k.to(device), v.to(device), kv.layer(0), backend.bind(prefix), layer, **extra)
        chunks.append(SequenceChunk(new, cached, pages))
    layout = BatchLayout(tuple(chunks), num_decodes=3, page_size=page_size)
    metadata = backend.bind(layout)
    assert metadata.phase is GraphPhase.MIXED
    queries = [torch.randn(n, heads, dim) for _, n in shapes]
    new_k = torch.cat([contexts[i][0][c:] for i, (c, _) in enumerate(shapes)])
    new_v = torch.cat([contexts[i][1][c:] for i, (c, _) in enumerate(shapes)])
    out = backend.forward(
        torch.cat(queries).to(device), new_k.to(device), new_v.to(device), kv.layer(0), metadata, layer, **extra
    )
    start = 0
    for index, (cached, new) in enumerate(shapes):
        expected = dense_reference(
            queries[index], *contexts[index], cached, layer.scale, window, sinks, layer.chunk_size
        )
        torch.testing.assert_close(out[start : start + new].cpu(), expected, atol=1e-5, rtol=1e-5)
        start += new


LATENT_CASES = [
    (backend, device, page_size, heads, pool_dtype)
    for backend in BACKENDS
    if LATENT_KV in backend.capabilities.kv_forms
    for device in backend_devices(backend)
    for page_size in supported((4, 16), backend.capabilities.page_sizes)
    for heads in (4, 20)  # one block of query heads, and two with the second partly padded
    for pool_dtype in (torch.float32, *sorted(backend.capabilities.kv_cache_dtypes, key=str))
]


@pytest.mark.parametrize("backend_cls, device, page_size, heads, pool_dtype", LATENT_CASES)
def test_backend_matches_dense_reference_over_a_latent_pool(backend_cls, device, page_size, heads, pool_dtype):
    """Multi-head latent attention: one KV head of latent + rotary dims whose values are the
    latents; the pool stores the keys alone, and every backend reads the values from them. A
    float8 pool reads back exactly the float8 values it was given."""
    torch.manual_seed(0)
    latent, rope = 32, 16
    dim = latent + rope
    layer = AttentionLayerSpec(heads, 1, dim, dim**-0.5, latent_dim=latent)
    spec = KVCacheSpec(1, 1, dim, pool_dtype, page_size, latent_dim=latent)
    kv = PagedKVProvider(spec, 64 * spec.bytes_per_page(), torch.device(device))
    backend = backend_cls(torch.device(device), page_size)
    shapes = [(9, 1), (0, 1), (40, 1), (0, 7), (13, 6), (3, 70)]  # as the mixed batch above
    contexts = {i: torch.randn(c + n, 1, dim).to(pool_dtype).float() for i, (c, n) in enumerate(shapes)}
    chunks = []
    for index, (cached, new) in enumerate(shapes):
        pages = tuple(kv.reserve(str(index), cached + new))
        if cached:
            prefix = BatchLayout((SequenceChunk(cached, 0, pages),), 0, page_size)
            keys = contexts[index][:cached].to(device)
            query = torch.randn(cached, heads, dim).to(device)
            backend.forward(query, keys, keys[..., :latent], kv.layer(0), backend.bind(prefix), layer)
        chunks.append(SequenceChunk(new, cached, pages))
    metadata = backend.bind(BatchLayout(tuple(chunks), num_decodes=3, page_size=page_size))
    queries = [torch.randn(n, heads, dim) for _, n in shapes]
    new_keys = torch.cat([contexts[i][c:] for i, (c, _) in enumerate(shapes)]).to(device)
    out = backend.forward(torch.cat(queries).to(device), new_keys, new_keys[..., :latent], kv.layer(0), metadata, layer)
    assert out.shape == (new_keys.shape[0], heads, latent)
    start = 0
    for index, (cached, new) in enumerate(shapes):
        keys = contexts[index]
        expected = dense_reference(queries[index], keys, keys[..., :latent], cached, layer.scale, None)
        torch.testing.assert_close(out[start : start + new].cpu(), expected, atol=1e-5, rtol=1e-5)
        start += new


FLOAT8 = torch.float8_e4m3fn
FLOAT8_CASES = [
    (backend, device, page_size, window, dtype)
    for backend in BACKENDS
    if FLOAT8 in backend.capabilities.kv_cache_dtypes and SEPARATE_KV in backend.capabilities.kv_forms
    for device in backend_devices(backend)
    for page_size in supported((4, 16), backend.capabilities.page_sizes)
    for window in (None, 5)
    # Triton's CPU interpreter does not compute bfloat16 faithfully; compiled, it does.
    for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if device == "cuda" else ())
]


@pytest.mark.parametrize("backend_cls, device, page_size, window, dtype", FLOAT8_CASES)
def test_backend_with_a_float8_pool_attends_over_the_rounded_keys_and_values(
    backend_cls, device, page_size, window, dtype
):
    """A float8 pool stores each key and value rounded to float8 and reads them back exactly:
    attention then matches the dense reference over the rounded context. (Inputs are already
    representable, so the check does not depend on how a device rounds.) Half-precision
    models widen the pool to their own dots' dtype, exactly; only their queries, scores'
    weights and outputs are rounded."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=FLOAT8, page_size=page_size)
    kv = PagedKVProvider(spec, 64 * spec.bytes_per_page(), torch.device(device))
    # Slots no sequence wrote hold stale values (a reused page): large ones here, which no
    # output may show, though a kernel may read whole pages.
    for pages in (kv.layer(0).key, kv.layer(0).value):
        pages.view(torch.uint8).fill_(0x7E)  # 448, float8 e4m3's largest
    backend = backend_cls(torch.device(device), page_size)

    def representable(*shape):
        return torch.randn(*shape).to(FLOAT8).to(dtype)

    shapes = [(0, 1), (21, 1), (0, 9), (0, 70)]  # a decode after a prefill, prefills
    contexts = [(representable(c + n, kv_heads, dim), representable(c + n, kv_heads, dim)) for c, n in shapes]
    pages = [tuple(kv.reserve(str(i), c + n)) for i, (c, n) in enumerate(shapes)]
    cached, new = shapes[1]
    prefix = backend.bind(BatchLayout((SequenceChunk(cached, 0, pages[1]),), 0, page_size))
    k, v = contexts[1][0][:cached], contexts[1][1][:cached]
    prefix_query = torch.randn(cached, heads, dim).to(device, dtype)
    backend.forward(prefix_query, k.to(device), v.to(device), kv.layer(0), prefix, layer)
    assert kv.layer(0).key.dtype == FLOAT8
    chunks = tuple(SequenceChunk(n, c, p) for (c, n), p in zip(shapes, pages))
    metadata = backend.bind(BatchLayout(chunks, num_decodes=2, page_size=page_size))
    queries = [torch.randn(n, heads, dim).to(dtype) for _, n in shapes]
    new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(contexts, shapes)])
    new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(contexts, shapes)])
    out = backend.forward(
        torch.cat(queries).to(device), new_k.to(device), new_v.to(device), kv.layer(0), metadata, layer
    )
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for query, context, (cached, new) in zip(queries, contexts, shapes):
        expected = dense_reference(query.float(), *(c.float() for c in context), cached, layer.scale, window)
        torch.testing.assert_close(out[start : start + new].float().cpu(), expected, atol=tolerance, rtol=tolerance)
        start += new


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's own float8 rounding needs a GPU")
def test_triton_store_rounds_to_float8_as_torch_does():
    from kestrel.core.attention.triton_paged import store_kv

    torch.manual_seed(0)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=64, dtype=FLOAT8, page_size=16)
    kv = PagedKVProvider(spec, 4 * spec.bytes_per_page(), torch.device("cuda"))
    key, value = (torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(2))
    slots = torch.tensor([0, 3, 17, 18, 40], device="cuda")
    store_kv(kv.layer(0), key, value, slots)
    for pages, new in ((kv.layer(0).key, key), (kv.layer(0).value, value)):
        stored = pages.view(torch.uint8)[:, slots // 16, slots % 16].transpose(0, 1)  # any page layout
        assert torch.equal(stored, new.to(FLOAT8).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, FLOAT8])
def test_triton_store_writes_every_head_of_each_token(dtype):
    """More kv heads than one store program takes, into either value layout (a float8 pool
    stores values slot-minor), with values float8 holds exactly (the interpreter's own
    float8 rounding is not the device's)."""
    from kestrel.core.attention.triton_paged import STORE_HEADS, TritonPagedBackend, store_kv

    devices = backend_devices(TritonPagedBackend)
    if not devices:
        pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    device, heads = torch.device(devices[0]), STORE_HEADS + 4
    spec = KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=64, dtype=dtype, page_size=16)
    kv = PagedKVProvider(spec, 4 * spec.bytes_per_page(), device)
    key, value = ((torch.randn(5, heads, 64) * 4).to(FLOAT8).float() for _ in range(2))
    slots = torch.tensor([0, 3, 17, 18, 40])
    store_kv(kv.layer(0), key.to(device), value.to(device), slots.to(device))
    for pages, new in ((kv.layer(0).key, key), (kv.layer(0).value, value)):
        stored = pages.view(torch.uint8)[:, slots // 16, slots % 16].view(dtype).transpose(0, 1)
        assert torch.equal(stored.float().cpu(), new)


def test_a_float8_pool_needs_a_backend_that_reads_it():
    needs = BackendRequirements("cpu", torch.float32, 64, False, 16, kv_cache_dtype=FLOAT8)
    assert select_backend(needs).name == "torch"  # the CPU backend's mirror keeps the model dtype
    with pytest.raises(NoAttentionBackendError, match="torch_cpu: kv cache dtype torch.float8_e4m3fn not supported"):
        select_backend(needs, preferred="torch_cpu")


STEP_CASES = [
    (backend, device, page_size, window)
    for backend in BACKENDS
    if SEPARATE_KV in backend.capabilities.kv_forms
    for device in backend_devices(backend)
    for page_size in supported((4, 16), backend.capabilities.page_sizes)
    for window in (None, 5)
]


@pytest.mark.parametrize("backend_cls, device, page_size, window", STEP_CASES)
def test_backend_stays_exact_over_decode_steps_as_the_batch_changes(backend_cls, device, page_size, window):
    """Backends may carry state between steps (the CPU backend's decode mirror): over many
    steps, with sequences joining, leaving and being reordered, every output stays exact."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    layer = AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32, page_size=page_size)
    kv = PagedKVProvider(spec, 256 * spec.bytes_per_page(), torch.device(device))
    backend = backend_cls(torch.device(device), page_size)
    contexts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(batch: list[tuple[str, int]]) -> None:
        """One step over `batch` (name, new tokens), decodes first; checks every layer's output."""
        chunks, queries, new_k, new_v = [], [], [], []
        for name, new in batch:
            cached = contexts[name][0].shape[0] if name in contexts else 0
            k, v = torch.randn(new, kv_heads, dim), torch.randn(new, kv_heads, dim)
            contexts[name] = (
                (torch.cat([contexts[name][0], k]), torch.cat([contexts[name][1], v])) if cached else (k, v)
            )
            pages = tuple(kv.reserve(name, cached + new))
            chunks.append(SequenceChunk(new, cached, pages))
            queries.append(torch.randn(new, heads, dim))
            new_k.append(k)
            new_v.append(v)
        num_decodes = sum(1 for _, new in batch if new == 1)
        metadata = backend.bind(BatchLayout(tuple(chunks), num_decodes, page_size))
        for layer_index in range(2):
            out = backend.forward(
                torch.cat(queries).to(device),
                torch.cat(new_k).to(device),
                torch.cat(new_v).to(device),
                kv.layer(layer_index),
                metadata,
                layer,
            )
            start = 0
            for (name, new), query in zip(batch, queries):
                cached = contexts[name][0].shape[0] - new
                expected = dense_reference(query, *contexts[name], cached, layer.scale, window)
                torch.testing.assert_close(out[start : start + new].cpu(), expected, atol=1e-5, rtol=1e-5)
                start += new

    step([("a", 9), ("b", 3)])
    for _ in range(3):
        step([("a", 1), ("b", 1)])
    step([("a", 1), ("b", 1), ("c", 5)])  # a prefill joins the decodes
    for _ in range(2):
        step([("a", 1), ("b", 1), ("c", 1)])
    step([("c", 1), ("a", 1)])  # b leaves, the rest reorder
    kv.release("b")
    step([("b2", 2)])  # prefill only: on the freed pages
    for _ in range(page_size + 2):  # across page boundaries
        step([("c", 1), ("a", 1), ("b2", 1)])
    for name in ("a", "b2", "c"):
        kv.release(name)
    assert kv.free_capacity() == kv.num_pages


def test_selection_explains_every_refusal():
    needs = BackendRequirements(device="tpu", dtype=torch.float32, head_dim=64, sliding_window=False, page_size=16)
    with pytest.raises(NoAttentionBackendError, match="torch: device tpu not in"):
        select_backend(needs)
    with pytest.raises(NoAttentionBackendError, match="unknown attention backend 'flash'"):
        select_backend(BackendRequirements("cpu", torch.float32, 64, False, 16), preferred="flash")


# ---- recipes -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_binds_every_checkpoint_tensor_exactly(family, checkpoint_dir):
    path = checkpoint_dir(family)
    config = AutoConfig.from_pretrained(path)
    recipe = recipe_for(config.architectures)
    spec = recipe.spec(config)
    latent = spec.attention_layers()[0].latent_dim is not None  # MLA: one latent KV head
    kv_heads = 1 if latent else config.num_key_value_heads
    assert (spec.num_heads, spec.num_kv_heads) == (config.num_attention_heads, kv_heads)
    tensors = load_file(path / "model.safetensors")

    def bind_all(state: dict[str, torch.Tensor]) -> None:
        model = build_empty(recipe, spec, torch.device("cpu"), torch.float32)
        bindings = recipe.bindings(model, spec)
        for name, tensor in state.items():
            bindings.bind(name, tensor)
        bindings.finish()

    bind_all(tensors)
    dropped = dict(tensors)
    if "model.layers.1.self_attn.k_proj.weight" in tensors:
        del dropped["model.layers.1.self_attn.k_proj.weight"]
        missing = r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"
    elif latent:
        del dropped["model.layers.1.self_attn.kv_b_proj.weight"]
        missing = r"model\.layers\.1\.self_attn\.kv_b_proj\.weight"
    else:  # q, k and v in one checkpoint tensor (Phi-3)
        del dropped["model.layers.1.self_attn.qkv_proj.weight"]
        missing = r"model\.layers\.1\.self_attn\.qkv_proj\.weight"
    with pytest.raises(WeightBindingError, match="missing from the checkpoint: " + missing):
        bind_all(dropped)
    extra = dict(tensors, **{"model.layers.0.mlp.extra.weight": torch.zeros(1)})
    with pytest.raises(WeightBindingError, match=r"unexpected in the checkpoint: model\.layers\.0\.mlp\.extra\.weight"):
        bind_all(extra)


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError) as error:
        recipe_for(["GPT2LMHeadModel"])
    for name in supported_architectures():
        assert name in str(error.value)
