"""CUDA graphs: bucket choice on any machine; identical outputs to eager on a GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.decode_graphs import decode_buckets
from kestrel.core.kernel_branches import kernels_on_cpu


def test_buckets_cover_every_batch_size_up_to_the_limit():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    buckets = decode_buckets(256)
    assert buckets[:7] == [1, 2, 4, 8, 16, 24, 32] and buckets[-1] == 256
    assert all(b - a <= 16 for a, b in zip(buckets, buckets[1:]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("batch", [1, 3, 9])  # 3 and 9 replay padded buckets (4 and 16)
def test_graphs_give_the_same_tokens_and_logprobs_as_eager(checkpoint_dir, batch):
    path = str(checkpoint_dir("qwen3"))
    generator = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 500, (5 + 7 * i,), generator=generator).tolist()} for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    common = dict(device="cuda", dtype="float32", page_size=16, kv_cache_memory_gb=0.25, max_num_seqs=16)
    graphed = LLM(path, **common)
    assert graphed.engine.parts.runner.graphs is not None
    eager = LLM(path, enforce_eager=True, **common)
    assert eager.engine.parts.runner.graphs is None
    for with_graphs, without in zip(
        graphed.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)
    ):
        assert with_graphs.outputs[0].token_ids == without.outputs[0].token_ids
        for a, b in zip(with_graphs.outputs[0].logprobs, without.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3-next"])
def test_verify_chunks_as_decode_rows_give_the_chunks_logits(checkpoint_dir, family, kernels):
    """The layout the verify steps take in captured graphs: a chunk of q tokens as q
    one-token rows of one sequence, run here eagerly through the decode path. A hybrid
    model's recurrent state folds the rows in one after another, as it would the chunk.
    `triton`: through the GPU's Triton attention backend and kernels, under the interpreter."""
    if kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton branches on CPU tensors need Triton's interpreter")
    with kernels_on_cpu() if kernels else contextlib.nullcontext():
        check_verify_rows(checkpoint_dir, family, kernels)


def check_verify_rows(checkpoint_dir, family: str, kernels: bool) -> None:
    from kestrel.core.runner import SequenceWork

    llm = LLM(str(checkpoint_dir(family)), device="cpu", page_size=16 if kernels else 4)
    parts = llm.engine.parts
    assert parts.runner.groups["kv"].binder.name.startswith("triton") == kernels
    runner, kv, recurrent = parts.runner, parts.kv, parts.recurrent
    prompt, verify = list(range(40, 61)), [7, 99, 3, 250, 18]

    def state_ids(request_id: str, tokens: int, tentative: bool = False) -> dict[str, tuple[int, ...]]:
        """Its recurrent slot; for a tentative chunk, read from the slot and written to a
        spare, so that the chunk and its rows both start from the same state."""
        if recurrent is None:
            return {}
        if tentative:
            recurrent.mark_rollback_point(request_id, tokens)
        return {recurrent.group: tuple(recurrent.reserve(request_id, tokens))}

    pages = tuple(kv.reserve("r", len(prompt) + len(verify)))
    greedy = SamplingParams(temperature=0)
    runner.execute([SequenceWork("r", tuple(prompt), 0, pages, 1, greedy, 0, state_ids=state_ids("r", 21))])
    # A decode row of another sequence beside it, as in a real verify step.
    other = tuple(kv.reserve("o", 9))
    runner.execute([SequenceWork("o", tuple(range(8)), 0, other, 1, greedy, 0, state_ids=state_ids("o", 8))])
    work = [
        SequenceWork("o", (9,), 8, other, 1, greedy, 0, state_ids=state_ids("o", 9, tentative=True)),
        SequenceWork(
            "r", tuple(verify), len(prompt), pages, len(verify), greedy, 0, state_ids=state_ids("r", 26, True)
        ),
    ]
    token_ids, logits_indices, _ = runner._host_inputs(work)
    results, states = [], []
    with torch.inference_mode():
        for as_rows in (False, True):
            layout = runner._layout(work, as_decode_rows=as_rows)
            assert layout.num_decodes == (1 + len(verify) if as_rows else 1)
            results.append(runner._run_eager(layout, token_ids, logits_indices, [])[1])
            if recurrent is not None:  # the state the chunk leaves in its spare slot
                spare = work[1].state_ids[recurrent.group][0]
                states.append([t.clone() for t in recurrent.unit_state(spare)])
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    for by_rows, by_chunk in zip(*states[::-1]):
        torch.testing.assert_close(by_rows, by_chunk, atol=1e-5, rtol=1e-5)
    assert runner._is_graph_row(work[1])  # verify rows may join the graphs
    # So may a verify chunk behind accepted drafts computed again, and the two tokens computed
    # again after a failed verify; a longer chunk that samples once or not at all may not.
    assert runner._is_graph_row(dataclasses.replace(work[1], token_ids=(1, 2, *verify)))
    assert runner._is_graph_row(dataclasses.replace(work[1], token_ids=(1, 2), num_samples=1))
    assert not runner._is_graph_row(dataclasses.replace(work[1], num_samples=1))
    assert not runner._is_graph_row(dataclasses.replace(work[1], num_samples=0))
    for request_id in ("r", "o"):
        kv.release(request_id)
        if recurrent is not None:
            recurrent.release(request_id)


def test_chained_verify_rows_replay_as_one_sequence_of_the_recurrent_state(checkpoint_dir):
    """What a decode graph's recurrent entries hold for a step of one decode row and a verify
    chunk of three rows, padded to 8: the decode, the chunk as one sequence of three rows
    from its read slot, the padded rows on the scratch slot, then entries of no rows."""
    from kestrel.core.batch import BatchLayout, SequenceChunk
    from kestrel.core.recurrent_state import chunk_ids
    from kestrel.core.workspace import Workspace

    recurrent = LLM(str(checkpoint_dir("qwen3-next")), device="cpu").engine.parts.recurrent
    workspace = Workspace(torch.device("cpu"))
    recurrent.prepare_capture(workspace, recurrent, 8, 4)
    group, scratch = recurrent.group, recurrent.scratch_id
    decode = SequenceChunk(1, 5, (0,), {group: (2,)})
    rows = [SequenceChunk(1, 9 + row, (1,), {group: chunk_ids(4, read_from=3)}) for row in range(3)]
    recurrent.prepare_replay(BatchLayout((decode, *rows), 4, 16), 8)
    vectors = recurrent._graph_vectors[:, :8].tolist()
    assert vectors[0] == [2, 4] + [scratch] * 6  # slot
    assert vectors[1] == [2, 3] + [scratch] * 6  # read from
    assert vectors[2] == [2, 4] + [scratch] * 6  # save to
    assert vectors[3] == [1, 1] + [0] * 6
    assert recurrent._graph_query_start[:9].tolist() == [0, 1, 4, 5, 6, 7, 8, 8, 8]
    # The next step of plain decodes gets one row per entry back.
    recurrent.prepare_replay(BatchLayout((decode,), 1, 16), 8)
    assert recurrent._graph_query_start[:9].tolist() == list(range(9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_speculative_verify_steps_replay_graphs_with_the_same_outputs(checkpoint_dir):
    path = str(checkpoint_dir("qwen3"))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 10, 11] * 7}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", page_size=16, kv_cache_memory_gb=0.25, max_num_seqs=16)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    expected = LLM(path, enforce_eager=True, **common).generate(prompts, params, use_tqdm=False)
    graphed = LLM(path, speculative_config=spec, **common)
    replays = []
    original = graphed.engine.parts.runner.graphs.run
    graphed.engine.parts.runner.graphs.run = lambda layout, *a: (replays.append(layout), original(layout, *a))[1]
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert any(len(layout.chunks) > 2 for layout in replays), "no verify step replayed a graph"
