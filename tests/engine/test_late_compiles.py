"""No Triton kernel compiles after start-up. Triton compiles a kernel again for each new
pattern of its integer arguments (1, divisible by 16, neither) and pointer alignments; an
argument that changes from step to step (a page table's width, a batch's row count, the rows
of a per-step array) would compile mid-serving, a stall of a second or more per variant that
no warm-up can foresee. Such arguments are marked not to be specialised on; this drives the
step shapes a server sees (odd counts, prompts continued over several chunks beside decoding
rows) and fails on any compile."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.bench.compiles import recorded_compiles
from tests.checkpoints import FAMILIES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles Triton kernels for a GPU")


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_steps_of_any_shape_compile_nothing_after_start_up(checkpoint_dir, family):
    llm = LLM(
        str(checkpoint_dir(family)),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=7,
        max_num_batched_tokens=96,
        kv_cache_memory_gb=0.25,
    )
    prompts = [list(range(3, 3 + length)) for length in (37, 101, 5, 250, 64, 17, 131, 9, 77)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 5 * index, ignore_eos=True) for index in range(len(prompts))]
    with recorded_compiles() as compiled:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert compiled == []
