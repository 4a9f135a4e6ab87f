"""CUDA graphs: bucket choice on any machine; identical outputs to eager on a GPU."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.cuda_graphs import decode_buckets


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
