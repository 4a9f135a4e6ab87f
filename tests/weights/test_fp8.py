"""FP8 checkpoints (transformers' `quant_method: "fp8"`, block scales): dequantized at load,
through the usual bindings, for every family; errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.weights.fp8 import Fp8CheckpointError, Fp8Config, dequantize
from tests.checkpoints import fp8_blocks, write_fp8_checkpoint
from tests.engine.test_async_scheduling import assert_same_outputs, generate


def test_block_scales_multiply_their_own_blocks_back():
    torch.manual_seed(0)
    weight = torch.randn(70, 45)  # blocks of 32 x 16 that do not divide it
    values, scale = fp8_blocks(weight, (32, 16))
    assert scale.shape == (3, 3)
    restored = dequantize(values, scale, (32, 16))
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (half a step), relative.
    assert ((restored - weight).abs() <= weight.abs() / 16 + 1e-6).all()
    # Each block uses its own scale: zeroing one block's scale zeroes exactly that block.
    scale[1, 2] = 0
    zeroed = dequantize(values, scale, (32, 16))
    assert (zeroed[32:64, 32:45] == 0).all() and (zeroed[:32] == restored[:32]).all()


def test_per_tensor_and_per_row_scales():
    values = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(torch.float8_e4m3fn)
    assert dequantize(values, torch.tensor(0.5), None).tolist() == [[0.5, -1.0], [0.25, 2.0]]
    assert dequantize(values, torch.tensor([[2.0], [1.0]]), None).tolist() == [[2.0, -4.0], [0.5, 4.0]]
    with pytest.raises(Fp8CheckpointError, match="needs scales of shape"):
        dequantize(values, torch.ones(3, 3), (1, 1))


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "qwen3-next"])
def test_an_fp8_checkpoint_runs_as_its_dequantized_weights(family, checkpoint_dir, tmp_path):
    """The FP8 checkpoint's outputs are those of a float checkpoint holding the same values
    (dequantized here, independently): greedy tokens identical, logprobs equal."""
    from safetensors.torch import load_file, save_file

    fp8 = write_fp8_checkpoint(checkpoint_dir(family), tmp_path / "fp8")
    plain = write_fp8_checkpoint(checkpoint_dir(family), tmp_path / "plain")  # then made float again
    tensors = load_file(plain / "model.safetensors")
    for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
        weight_name = name.removesuffix("_scale_inv")
        scale = tensors.pop(name)
        spread = torch.kron(scale, torch.ones(32, 32))[: tensors[weight_name].shape[0], : tensors[weight_name].shape[1]]
        tensors[weight_name] = tensors[weight_name].float() * spread
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))

    prompts = [{"prompt_token_ids": list(range(20 + i, 60 + 3 * i))} for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)] * 3
    common = dict(device="cpu", dtype="float32", page_size=8)
    expected = generate(LLM(str(plain), **common), prompts, params)
    assert_same_outputs(generate(LLM(str(fp8), **common), prompts, params), expected)


def test_fp8_loading_errors_name_what_is_wrong(checkpoint_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = write_fp8_checkpoint(checkpoint_dir("qwen3"), tmp_path / "no-scale")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Fp8CheckpointError, match="model.layers.0.mlp.down_proj.weight_scale_inv"):
        LLM(str(broken), device="cpu")
    with pytest.raises(Fp8CheckpointError, match="weight_block_size must be two positive sizes"):
        Fp8Config.from_quantization_config({"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(Fp8CheckpointError, match="activation_scheme"):
        Fp8Config.from_quantization_config({"quant_method": "fp8", "activation_scheme": "sometimes"})
