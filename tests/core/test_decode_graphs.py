"""CUDA graphs: bucket choice on any machine; identical outputs to eager on a GPU."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.decode_graphs import decode_buckets


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


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_verify_chunks_as_decode_rows_give_the_chunks_logits(checkpoint_dir, family):
    """The layout the verify steps take in captured graphs: a chunk of q tokens as q
    one-token rows of one sequence, run here eagerly through the decode path."""
    from kestrel.core.runner import SequenceWork

    llm = LLM(str(checkpoint_dir(family)), device="cpu", page_size=4)
    runner, kv = llm.engine.parts.runner, llm.engine.parts.kv
    prompt, verify = list(range(40, 61)), [7, 99, 3, 250, 18]
    pages = tuple(kv.reserve("r", len(prompt) + len(verify)))
    greedy = SamplingParams(temperature=0)
    runner.execute([SequenceWork("r", tuple(prompt), 0, pages, 1, greedy, 0)])
    # A decode row of another sequence beside it, as in a real verify step.
    other = tuple(kv.reserve("o", 9))
    runner.execute([SequenceWork("o", tuple(range(8)), 0, other, 1, greedy, 0)])
    work = [
        SequenceWork("o", (9,), 8, other, 1, greedy, 0),
        SequenceWork("r", tuple(verify), len(prompt), pages, len(verify), greedy, 0),
    ]
    token_ids, logits_indices, _ = runner._host_inputs(work)
    results = []
    with torch.inference_mode():
        for as_rows in (False, True):
            layout = runner._layout(work, verify_as_decode_rows=as_rows)
            assert layout.num_decodes == (1 + len(verify) if as_rows else 1)
            results.append(runner._run_eager(layout, token_ids, logits_indices, [])[1])
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    assert runner._is_graph_row(work[1])  # attention-only: verify rows may join the graphs
    kv.release("r")
    kv.release("o")


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
