"""The gated delta rule's Triton kernels against the torch reference (gated_delta.py): random
sequence lengths in one step, some sequences carrying state and some starting fresh, slots
out of order, float32 and bf16."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kestrel.core.metadata import PrefillChunks, RecurrentMetadata, chunk_indices
from kestrel.layers.gated_delta import causal_conv, chunked_gated_delta, l2_normalize
from kestrel.layers.gated_delta_kernels import causal_conv_varlen, gated_delta_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)",
)

STEPS = {
    "decodes": [1, 1, 1],
    "prefills": [5, 17],
    "mixed": [1, 1, 9, 3],
}


def _step(lengths: list[int], num_slots: int, seed: int, snapshots: bool):
    """query_start, slots (a permutation: sequences do not sit in slot order), read slots,
    save slots, has_state. With snapshots, the first sequence starts from a snapshot slot
    and the last also saves into one (the slots past the first len(lengths) + 1)."""
    generator = torch.Generator().manual_seed(seed)
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(len(lengths) + 1, generator=generator)[: len(lengths)]
    reads, saves = slots.clone(), slots.clone()
    if snapshots:
        reads[0], saves[-1] = num_slots - 1, num_slots - 2
    has_state = torch.tensor([index % 3 != 1 for index in range(len(lengths))])
    return query_start, slots, reads, saves, has_state


# Each case runs under the interpreter in CI: a spread of steps, dtypes and slot uses rather
# than their full product.
CONV_CASES = pytest.mark.parametrize(
    "step, dtype, snapshots",
    [
        ("mixed", torch.float32, True),
        ("mixed", torch.bfloat16, False),
        ("decodes", torch.bfloat16, True),
        ("prefills", torch.float32, False),
    ],
)


@CONV_CASES
def test_convolution_kernel_matches_the_reference(step, dtype, snapshots):
    lengths = STEPS[step]
    channels, width, num_slots = 40, 3, 8
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(sum(lengths), channels, generator=generator).to(dtype)
    prior = torch.randn(num_slots, channels, width, generator=generator).to(dtype)
    weight = torch.randn(channels, width + 1, generator=generator).to(dtype)
    query_start, slots, reads, saves, has_state = _step(lengths, num_slots, 1, snapshots)

    expected_prior = prior.clone()
    expected = torch.empty_like(x)
    for index, (slot, read, save) in enumerate(zip(slots.tolist(), reads.tolist(), saves.tolist())):
        rows = slice(query_start[index], query_start[index + 1])
        start = prior[read] if has_state[index] else torch.zeros_like(prior[read])
        expected[rows], new_prior = causal_conv(x[rows], start.float(), weight.float())
        expected_prior[slot] = expected_prior[save] = new_prior

    on = {name: t.to(DEVICE) for name, t in dict(x=x, prior=prior.clone(), weight=weight).items()}
    step_ids = [t.to(DEVICE) for t in (query_start, slots, has_state, reads, saves)]
    got = causal_conv_varlen(on["x"], on["prior"], on["weight"], *step_ids)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.cpu(), expected, **tolerance)
    torch.testing.assert_close(on["prior"].cpu(), expected_prior.to(dtype), **tolerance)


def _reference_delta(mixed, a, b, a_log, dt_bias, state, query_start, slots, reads, saves, has_state, key_heads):
    """GatedDeltaNet's torch path: norms, gates and the chunked rule, one sequence at a time."""
    value_heads, key_dim, value_dim = state.shape[1:]
    tokens = mixed.shape[0]
    q, k, v = mixed.float().split((key_heads * key_dim, key_heads * key_dim, value_heads * value_dim), dim=-1)
    group = value_heads // key_heads
    q = (l2_normalize(q.view(tokens, key_heads, key_dim)) * key_dim**-0.5).repeat_interleave(group, dim=1)
    k = l2_normalize(k.view(tokens, key_heads, key_dim)).repeat_interleave(group, dim=1)
    v = v.view(tokens, value_heads, value_dim)
    log_decay = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    out = torch.empty(tokens, value_heads, value_dim)
    state = state.clone()
    for index, (slot, read, save) in enumerate(zip(slots.tolist(), reads.tolist(), saves.tolist())):
        rows = slice(query_start[index], query_start[index + 1])
        start = state[read] if has_state[index] else torch.zeros_like(state[read])
        out[rows], new = chunked_gated_delta(q[rows], k[rows], v[rows], log_decay[rows], beta[rows], start)
        state[slot] = state[save] = new
    return out, state


GROUPED_HEADS, ONE_HEAD = (2, 4, 16, 16), (1, 1, 8, 40)  # value heads per key head; a value width over 32


@pytest.mark.parametrize(
    "step, dtype, heads, snapshots",
    [
        ("mixed", torch.float32, GROUPED_HEADS, True),
        ("mixed", torch.bfloat16, GROUPED_HEADS, False),
        ("decodes", torch.bfloat16, GROUPED_HEADS, True),
        ("decodes", torch.float32, ONE_HEAD, False),
        ("prefills", torch.float32, GROUPED_HEADS, True),
        ("prefills", torch.bfloat16, ONE_HEAD, False),
    ],
)
def test_delta_kernel_matches_the_reference(step, dtype, heads, snapshots):
    key_heads, value_heads, key_dim, value_dim = heads
    lengths = STEPS[step]
    num_slots, tokens = 8, sum(lengths)
    generator = torch.Generator().manual_seed(3)
    width = 2 * key_heads * key_dim + value_heads * value_dim
    mixed = torch.randn(tokens, width, generator=generator).to(dtype)
    # a and b as views of one projection's output, as the layer hands them over.
    gates = torch.randn(tokens, 2 * value_heads + 3, generator=generator).to(dtype)
    b, a = gates[:, :value_heads], gates[:, value_heads : 2 * value_heads]
    a_log = torch.randn(value_heads, generator=generator) * 0.5
    dt_bias = torch.randn(value_heads, generator=generator)
    state = torch.randn(num_slots, value_heads, key_dim, value_dim, generator=generator)
    query_start, slots, reads, saves, has_state = _step(lengths, num_slots, 2, snapshots)

    expected, expected_state = _reference_delta(
        mixed, a, b, a_log, dt_bias, state, query_start, slots, reads, saves, has_state, key_heads
    )
    device_state, device_gates = state.to(DEVICE), gates.to(DEVICE)
    got = gated_delta_varlen(
        mixed.to(DEVICE),
        device_gates[:, value_heads : 2 * value_heads],
        device_gates[:, :value_heads],
        a_log.to(DEVICE),
        dt_bias.to(DEVICE),
        device_state,
        query_start.to(DEVICE),
        slots.to(DEVICE),
        has_state.to(DEVICE),
        key_heads,
        reads.to(DEVICE),
        saves.to(DEVICE),
    )
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float().cpu(), expected.to(dtype).float(), **tolerance)
    # The state stays float32 whatever the activations: it must track the reference closely.
    torch.testing.assert_close(device_state.cpu(), expected_state, atol=1e-4, rtol=1e-4)


def test_a_bfloat16_state_is_read_widened_and_saved_rounded():
    """`mamba_ssm_cache_dtype="bfloat16"`: the kernel starts from the stored bf16 state widened
    to float32, runs each sequence's rows in float32, and rounds only what it saves."""
    key_heads, value_heads, key_dim, value_dim = GROUPED_HEADS
    lengths = STEPS["mixed"]
    num_slots, tokens = 8, sum(lengths)
    generator = torch.Generator().manual_seed(5)
    mixed = torch.randn(tokens, 2 * key_heads * key_dim + value_heads * value_dim, generator=generator)
    a, b = torch.randn(2, tokens, value_heads, generator=generator)
    a_log, dt_bias = torch.randn(value_heads, generator=generator) * 0.5, torch.randn(value_heads, generator=generator)
    state = torch.randn(num_slots, value_heads, key_dim, value_dim, generator=generator).to(torch.bfloat16)
    query_start, slots, reads, saves, has_state = _step(lengths, num_slots, 2, True)
    expected, expected_state = _reference_delta(
        mixed, a, b, a_log, dt_bias, state.float(), query_start, slots, reads, saves, has_state, key_heads
    )
    device_state = state.to(DEVICE)
    b_and_a = torch.stack((b, a)).to(DEVICE)
    got = gated_delta_varlen(
        mixed.to(DEVICE), b_and_a[1], b_and_a[0], a_log.to(DEVICE), dt_bias.to(DEVICE), device_state,
        query_start.to(DEVICE), slots.to(DEVICE), has_state.to(DEVICE), key_heads, reads.to(DEVICE), saves.to(DEVICE),
    )  # fmt: skip
    assert device_state.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    # Rounded once when saved: within one bf16 step of the float32 reference state.
    torch.testing.assert_close(device_state.cpu().float(), expected_state, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("family, chunked_prefills", [("qwen3-next", False), ("qwen3.5", False), ("qwen3-next", True)])
def test_a_layer_mixes_the_same_through_kernels_and_torch(checkpoint_dir, family, chunked_prefills, monkeypatch):
    """One loaded DeltaNet layer, a step of two decodes (one fresh) and two prefills (one
    continuing its state): both paths give the same output and leave the same state. With
    `chunked_prefills` the kernel path splits the step as it does where the chunked kernels
    run (a GPU with flash-linear-attention): they are stood in for by the recurrence over the
    rows, bounds and slots the split hands them, so what is checked is the split."""
    from kestrel import LLM
    from kestrel.core.batch import BatchLayout, SequenceChunk
    from kestrel.core.recurrent_state import RECURRENT_GROUP
    from kestrel.models import hybrid
    from kestrel.models.hybrid import GatedDeltaNet

    handed: list[tuple[int, tuple[int, ...]]] = []

    def recurrence_for_chunks(mixed, a, b, a_log, dt_bias, state, prefills, *slot_args):
        handed.append((mixed.shape[0], tuple(prefills.bounds.tolist())))
        query_start = prefills.bounds_on_device.to(torch.int32)
        return gated_delta_varlen(mixed, a, b, a_log, dt_bias, state, query_start, *slot_args)

    if chunked_prefills:
        monkeypatch.setattr(hybrid, "takes_chunked", lambda mixed, rows: True)
        monkeypatch.setattr(hybrid, "gated_delta_chunked", recurrence_for_chunks)

    # Built on the CPU in float32 (the layer then moves to DEVICE): on a GPU the engine would
    # default to bfloat16 and size its pools from the whole device.
    parts = LLM(str(checkpoint_dir(family)), device="cpu", dtype="float32", page_size=8, max_num_seqs=4).engine.parts
    layer = next(m for m in parts.runner.model.modules() if isinstance(m, GatedDeltaNet)).to(DEVICE)
    provider = parts.recurrent
    provider.device = torch.device(DEVICE)
    chunks = [
        SequenceChunk(query_len, cached, (), {RECURRENT_GROUP: (slot,)})
        for query_len, cached, slot in [(1, 5, 2), (1, 0, 0), (7, 0, 3), (4, 9, 1)]
    ]
    meta = provider.bind(BatchLayout(tuple(chunks), 2, 8))
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(13, parts.spec.hidden_size, generator=generator).to(DEVICE)
    mixed, _, b, a = layer.in_proj.split(layer.in_proj(hidden))
    states = {}
    for path in ("kernels", "torch"):
        torch.manual_seed(9)  # both start from the same (random) slot contents
        state = provider.layer(layer.state_index)
        state = type(state)(torch.randn_like(state.conv).to(DEVICE), torch.randn_like(state.recurrent).to(DEVICE))
        mix = layer.mix_with_kernels if path == "kernels" else layer.mix_with_torch
        states[path] = (mix(mixed, a, b, state, meta), state)
    (out, state), (expected, expected_state) = states["kernels"], states["torch"]
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    used = [0, 1, 2, 3]
    torch.testing.assert_close(state.conv[used], expected_state.conv[used], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.recurrent[used], expected_state.recurrent[used], atol=1e-4, rtol=1e-4)
    assert handed == ([(11, (0, 7, 11))] if chunked_prefills else [])  # the prefills' rows, from 0


def test_the_chunked_kernels_get_each_chunks_sequence_and_place_from_the_host():
    """Sequences of 64, 1 and 135 tokens: one chunk, one partial chunk, two whole and a
    partial; an empty sequence (a slot the step does not touch) has none."""
    got = chunk_indices(torch.tensor([0, 64, 65, 65, 200]), 64)
    assert got.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
    assert got.dtype == torch.long


def test_a_steps_prefill_chunks_count_from_the_first_prefill_row_and_are_made_once():
    """Two decodes, then prefills of 70 and 3 tokens: bounds from the first prefill's row,
    the chunks of 64 that cut them, and the same object for every layer that asks."""
    meta = _metadata((0, 1, 2, 72, 75), num_decodes=2)
    chunks = meta.prefill_chunks(64)
    assert chunks.bounds.tolist() == [0, 70, 73]
    assert chunks.bounds_on_device.tolist() == [0, 70, 73]
    assert chunks.chunks_on_device.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert meta.prefill_chunks(64) is chunks
    assert meta.prefill_chunks(32).chunks_on_device.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]


def _metadata(query_start_loc: tuple[int, ...], num_decodes: int) -> RecurrentMetadata:
    count = len(query_start_loc) - 1
    ids = torch.arange(count)
    starts = torch.tensor(query_start_loc, dtype=torch.int32)
    zeros = (0,) * count
    return RecurrentMetadata(
        num_decodes, query_start_loc, zeros, zeros, zeros, (False,) * count, ids, ids, ids, ids > count, starts
    )


@pytest.mark.skipif(DEVICE != "cuda", reason="flash-linear-attention's chunked kernels run on CUDA only")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_kernels_match_the_token_by_token_kernel(state_dtype):
    """gated_delta_chunked (prefills, tensor-core chunks) against gated_delta_varlen on the
    same step of bf16 rows: sequences of 70 to 700 tokens (partial last chunks), some with
    prior state, one reading a snapshot and one saving into another."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from kestrel.layers.gated_delta_kernels import gated_delta_chunked

    lengths = [300, 70, 700, 129]
    key_heads, value_heads, key_dim, value_dim, num_slots = 2, 4, 128, 128, 8
    generator = torch.Generator().manual_seed(11)
    tokens = sum(lengths)
    width = 2 * key_heads * key_dim + value_heads * value_dim
    mixed = torch.randn(tokens, width, generator=generator).to(DEVICE, torch.bfloat16)
    gates = torch.randn(tokens, 2 * value_heads, generator=generator).to(DEVICE, torch.bfloat16)
    a, b = gates[:, :value_heads], gates[:, value_heads:]  # views of one projection
    a_log = torch.rand(value_heads, generator=generator).log().to(DEVICE)
    dt_bias = torch.randn(value_heads, generator=generator).to(DEVICE)
    state = (0.1 * torch.randn(num_slots, value_heads, key_dim, value_dim, generator=generator)).to(DEVICE, state_dtype)
    query_start, slots, reads, saves, has_state = (t.to(DEVICE) for t in _step(lengths, num_slots, 3, True))

    expected_state = state.clone()
    expected = gated_delta_varlen(
        mixed, a, b, a_log, dt_bias, expected_state, query_start, slots, has_state, key_heads, reads, saves
    )
    bounds = query_start.long().cpu()
    prefills = PrefillChunks(bounds, bounds.to(DEVICE), chunk_indices(bounds, 64).to(DEVICE))
    got = gated_delta_chunked(mixed, a, b, a_log, dt_bias, state, prefills, slots, has_state, key_heads, reads, saves)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(state.float(), expected_state.float(), atol=3e-2, rtol=3e-2)
