"""AWQ and GPTQ checkpoints (weights/packed_ints.py): the tests pack a tiny Llama as
AutoAWQ and AutoGPTQ lay their tensors out, and loading it must give exactly the float
weights those codes mean (a reference checkpoint holding them), on every path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.weights.checkpoint import UnsupportedQuantizationError
from kestrel.weights.packed_ints import AWQ_ORDER, unpack_columns, unpack_rows
from tests.checkpoints import pack_columns, write_packed_int_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 9, 14, 3], [100, 7, 42, 42, 8, 1]]


def test_awq_interleaves_the_columns_of_each_int32():
    codes = torch.arange(16).reshape(1, 16) % 16
    packed = pack_columns(codes, 4, AWQ_ORDER)
    # Element i (bits 4i..4i+3) holds column AWQ_ORDER[i]: columns 0, 2, 4, 6, 1, 3, 5, 7.
    assert [(int(packed[0, 0]) >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(unpack_columns(packed, 4, AWQ_ORDER), codes)


def test_gptq_packs_eight_rows_into_each_int32():
    codes = torch.randint(0, 16, (16, 3))
    packed = pack_columns(codes.t(), 4).t().contiguous()
    assert packed.shape == (2, 3) and packed.dtype == torch.int32
    assert torch.equal(unpack_rows(packed, 4), codes)
    assert (int(packed[1, 2]) >> 4) & 0xF == codes[9, 2]  # row 8 * 1 + 1, element 1


def run(path, **engine) -> list:
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, **engine)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("method, act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_a_packed_checkpoint_runs_as_the_float_weights_its_codes_mean(method, act_order, checkpoint_dir, tmp_path):
    reference = tmp_path / "reference"
    packed = write_packed_int_checkpoint(
        checkpoint_dir("llama"), tmp_path / method, reference, method, act_order=act_order
    )
    # `quantization=` may name the checkpoint's own method, as vLLM takes it.
    for got, expected in zip(run(packed, quantization=method), run(reference)):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        for position, token in enumerate(expected.outputs[0].token_ids):
            assert (
                got.outputs[0].logprobs[position][token].logprob
                == expected.outputs[0].logprobs[position][token].logprob
            )


def test_unsupported_packed_layouts_are_named(checkpoint_dir, tmp_path):
    path = tmp_path / "awq"
    shutil.copytree(checkpoint_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    for quantization, message in [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits is not supported"),
        ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported yet"),
    ]:
        (path / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization)))
        with pytest.raises(UnsupportedQuantizationError, match=message):
            LLM(str(path))


def test_a_layer_without_its_scales_is_named(checkpoint_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    packed = write_packed_int_checkpoint(checkpoint_dir("llama"), tmp_path / "awq", tmp_path / "ref", "awq")
    tensors = load_file(packed / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, packed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.qweight is packed .* no .*down_proj\.scales"
    ):
        LLM(str(packed))
