"""Tensor parallelism on the CPU (gloo): TP=2 gives TP=1's greedy tokens for every family
it supports, and a worker that dies makes the engine fail fast with a clear error. With two
GPUs, the same parity over NCCL, eager and replayed from CUDA graphs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.distributed import WorkerDiedError
from tests.checkpoints import FAMILIES

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts() -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(0, 500, (n,), generator=generator).tolist()} for n in (1, 9, 70)]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_give_the_same_greedy_tokens_as_one(family, checkpoint_dir):
    path = str(checkpoint_dir(family))
    settings = dict(max_num_batched_tokens=32, dtype="float32", kv_cache_memory_gb=0.05)
    single = LLM(path, **settings).generate(prompts(), GREEDY, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **settings)
    try:
        # Overlapped steps: the workers take the tokens rank 0 sampled by a broadcast.
        assert llm.engine._overlap
        split = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
        stats = llm.engine.stats()
        assert stats.num_used_pages == 0 and stats.num_running == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_two_gpus_give_the_same_greedy_tokens_as_one(enforce_eager, checkpoint_dir):
    # float32, so that the all-reduce's summation order cannot flip a greedy choice.
    settings = dict(device="cuda", dtype="float32", kv_cache_memory_gb=0.5, enforce_eager=enforce_eager)
    path = str(checkpoint_dir("llama"))
    single = LLM(path, **settings)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts(), GREEDY, use_tqdm=False)]
    single.engine.shutdown()
    llm = LLM(path, tensor_parallel_size=2, **settings)
    try:
        split = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in split] == expected
    finally:
        llm.engine.shutdown()


def test_a_killed_worker_fails_the_engine_fast(checkpoint_dir):
    llm = LLM(str(checkpoint_dir("qwen3")), tensor_parallel_size=2, kv_cache_memory_gb=0.05)
    engine = llm.engine
    try:
        engine.add_request("r", prompts()[1]["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.step()
        worker = engine.parts.executor.workers[0]
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) died"):
            engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.shutdown()


def test_two_ranks_through_a_local_ray_cluster(checkpoint_dir):
    ray = pytest.importorskip("ray")
    path = str(checkpoint_dir("llama"))
    settings = dict(max_num_batched_tokens=32, dtype="float32", kv_cache_memory_gb=0.05)
    single = LLM(path, **settings).generate(prompts(), GREEDY, use_tqdm=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # one host, room for the actor
    try:
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **settings)
        try:
            split = llm.generate(prompts(), GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
            assert len(llm.engine.parts.executor.actors) == 1
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "device, rank, expected",
    [("cuda", 1, "cuda:1"), ("cuda:2", 1, "cuda:3"), ("cpu", 1, "cpu"), ("cuda:0", 0, "cuda:0")],
)
def test_each_cuda_rank_gets_its_own_device(device, rank, expected):
    from kestrel.config import EngineArgs
    from kestrel.engine.distributed import rank_args

    assert rank_args(EngineArgs(model="m", device=device), rank).device == expected
