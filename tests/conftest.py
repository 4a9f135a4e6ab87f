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
