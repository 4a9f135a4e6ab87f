"""One bf16 request decoded on a GPU through the one-row matvecs (fused with rotary and
SiLU), replayed from CUDA graphs with dependent launches, gives the same bits as eager
launches that each wait for the one before."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.runtime import dependent_launch
from kestrel.layers import gemv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="dependent launch and graphs need a GPU")


def decode_one(path, **engine_args):
    llm = LLM(str(path), dtype="bfloat16", device="cuda", page_size=16, kv_cache_memory_gb=0.25, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    completion = llm.generate({"prompt_token_ids": list(range(3, 40))}, params, use_tqdm=False)[0].outputs[0]
    logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
    return completion.token_ids, logprobs


def test_dependent_launches_in_graphs_give_the_bits_of_eager_independent_launches(checkpoint_dir, monkeypatch):
    path = checkpoint_dir("llama")
    # Tiny weights might time faster on cuBLAS; the matvecs are what this checks.
    monkeypatch.setattr(gemv, "prefers_gemv", lambda weight: True)
    fast = decode_one(path)
    assert dependent_launch.dependent_launch(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    try:
        plain = decode_one(path, enforce_eager=True, dependent_launch=False)
        assert not dependent_launch.dependent_launch(torch.device("cuda"))
    finally:
        dependent_launch.configure(True)
    assert fast == plain
