"""Tensor parallelism on the CPU (gloo): TP=2 gives TP=1's greedy tokens for every family
it supports, and a worker that dies makes the engine fail fast with a clear error. With two
GPUs, the same parity over NCCL, eager and replayed from CUDA graphs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.distributed.executor import WorkerDiedError
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
        worker.process.wait(timeout=10)
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
    from kestrel.distributed.group import rank_args

    assert rank_args(EngineArgs(model="m", device=device), rank).device == expected


def test_a_script_without_a_main_guard_starts_its_workers(checkpoint_dir, tmp_path):
    """Workers never import the user's script: one without `if __name__ == "__main__":` works."""
    script = tmp_path / "generate.py"
    script.write_text(
        "from kestrel import LLM, SamplingParams\n"
        f"llm = LLM({str(checkpoint_dir('qwen3'))!r}, tensor_parallel_size=2, kv_cache_memory_gb=0.05)\n"
        "params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
        "output = llm.generate({'prompt_token_ids': [5, 6, 7]}, params, use_tqdm=False)[0]\n"
        "print('tokens', output.outputs[0].token_ids)\n"
    )
    root = Path(__file__).resolve().parents[2]
    environment = dict(os.environ, PYTHONPATH=str(root))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("tokens [") == 1  # printed once: the workers did not run the script


def test_a_worker_that_cannot_start_fails_within_seconds(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 exited with code 1 before it connected"):
        LLM(str(checkpoint_dir("qwen3")), tensor_parallel_size=2, kv_cache_memory_gb=0.05)
    assert time.monotonic() - start < 15


def test_engines_one_after_another_in_one_process(checkpoint_dir):
    path = str(checkpoint_dir("qwen3"))
    settings = dict(tensor_parallel_size=2, kv_cache_memory_gb=0.05)
    request = {"prompt_token_ids": [5, 6, 7]}
    with LLM(path, **settings) as llm:
        expected = llm.generate(request, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    explicit = LLM(path, **settings)
    assert explicit.generate(request, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    explicit.shutdown()
    collected = LLM(path, **settings)  # deleted, not shut down: collection releases it
    del collected
    last = LLM(path, **settings)
    try:
        assert last.generate(request, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
        with pytest.raises(RuntimeError, match="another tensor-parallel engine in this process"):
            LLM(path, **settings)
    finally:
        last.shutdown()


def test_two_ranks_speculating_give_the_same_greedy_tokens_as_one(checkpoint_dir):
    """Verify chunks and rollback on two ranks: each rank rolls its shard of the KV back."""
    path = str(checkpoint_dir("qwen3"))
    settings = dict(max_num_batched_tokens=32, dtype="float32", kv_cache_memory_gb=0.05)
    looping = [{"prompt_token_ids": [31, 42, 53, 64] * 5}, {"prompt_token_ids": [7, 8, 9] * 6}]
    single = LLM(path, **settings).generate(looping, GREEDY, use_tqdm=False)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(path, tensor_parallel_size=2, speculative_config=config, **settings)
    try:
        split = llm.generate(looping, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
        assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()
