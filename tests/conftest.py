from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: Triton kernels run under Triton's interpreter, on CPU tensors. Must be set
    # before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker takes one core's share, so workers do not fight over threads.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

from tests.checkpoints import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """family -> path of a tiny random checkpoint, written once per session."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = write_checkpoint(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def qwen3_llm(checkpoint_dir):
    """One shared engine on the tiny Qwen3 checkpoint, small batches so chunking happens."""
    from kestrel import LLM

    return LLM(str(checkpoint_dir("qwen3")), max_num_batched_tokens=64, page_size=8)


# Test tiers. `slow`: modules that start servers or worker processes, or run a real model;
# `triton_interpreter`: Triton kernels run by Triton's interpreter on the CPU (slow there,
# native on a GPU). `scripts/test.sh --fast` leaves both out (the inner loop, under 90 s);
# CI runs everything.
SLOW_MODULES = {
    "tests/weights/test_smollm2.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/test_cli.py",
    "tests/test_packaging.py",
    "tests/server/test_lifecycle.py",
    "tests/server/test_logging.py",
    "tests/server/test_hostile_input.py",
    "tests/server/test_server.py",
    "tests/server/test_structured_outputs.py",
    "tests/server/test_agent_apis.py",
    "tests/server/test_speculative_server.py",
    "tests/server/test_disaggregation.py",
}
TRITON_MODULES = {
    "tests/core/test_triton_decode_splits.py",
    "tests/core/test_triton_prefill_blocks.py",
    "tests/core/test_triton_compiles.py",
    "tests/core/test_dependent_launch.py",
    "tests/engine/test_dependent_launch_decode.py",
    "tests/layers/test_gemv.py",
    "tests/layers/test_fused.py",
    "tests/layers/test_fused_moe.py",
    "tests/layers/test_gated_delta_kernels.py",
    "tests/test_kernel_branches.py",
}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts servers or worker processes, or runs a real model")
    config.addinivalue_line("markers", "triton_interpreter: Triton kernels, interpreted on a machine without a GPU")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = item.nodeid.split("::")[0]
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if module in TRITON_MODULES or "TritonPagedBackend" in item.nodeid:
            item.add_marker(pytest.mark.triton_interpreter)
