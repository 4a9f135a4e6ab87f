"""MXFP4 checkpoints (GPT-OSS's experts): codes read as transformers reads them, and a model
whose experts are stored so gives exactly the outputs of the floats those codes mean."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.weights.mxfp4 import Mxfp4CheckpointError, dequantize
from tests.checkpoints import mxfp4_pack, write_mxfp4_checkpoint


def test_codes_mean_what_transformers_reads():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 134, (3, 8, 2), dtype=torch.uint8, generator=generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize(blocks, scales, "w"), expected)


def test_packing_keeps_each_value_within_half_a_step():
    weight = torch.randn(4, 6, 64) * torch.logspace(-3, 1, 6)[:, None]
    blocks, scales = mxfp4_pack(weight)
    back = dequantize(blocks, scales, "w").transpose(-2, -1)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # e2m1 steps are at most 2
    assert ((back - weight).abs() <= step).all()


def test_blocks_without_their_scales_are_named():
    with pytest.raises(Mxfp4CheckpointError, match="do not match"):
        dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "experts.w")


def test_an_mxfp4_gpt_oss_gives_the_outputs_of_its_dequantized_floats(checkpoint_dir, tmp_path):
    packed = write_mxfp4_checkpoint(checkpoint_dir("gpt-oss"), tmp_path / "mxfp4", tmp_path / "floats")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(5, 40, 3))}, {"prompt_token_ids": [7, 1, 300, 42]}]
    got = LLM(str(packed), page_size=8, quantization="mxfp4").generate(prompts, params, use_tqdm=False)
    expected = LLM(str(tmp_path / "floats"), page_size=8).generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in x.items()} == {t: v.logprob for t, v in y.items()}
