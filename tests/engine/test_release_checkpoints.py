"""Checkpoints as they are released: multimodal Qwen3.5 folders (a vision tower beside the text
model), multi-token-prediction heads, quantization configs, folders without tokenizer files."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kestrel import LLM, SamplingParams
from kestrel.weights.checkpoint import UnsupportedQuantizationError
from tests.checkpoints import COMMON, HYBRID, tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 17, 40)]
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)


def text_fields(moe: bool) -> dict:
    fields = dict(COMMON, **HYBRID, vocab_size=len(tokenizer()), eos_token_id=tokenizer().eos_token_id)
    if moe:
        fields.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
    return fields


def write_vision_language(directory: Path, moe: bool) -> Path:
    """A tiny `Qwen3_5(Moe)ForConditionalGeneration` release, with MTP heads in a file of their own."""
    if moe:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig as Config
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration as Model
    else:
        from transformers.models.qwen3_5 import Qwen3_5Config as Config
        from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration as Model
    torch.manual_seed(0)
    model = Model(Config(text_config=text_fields(moe), vision_config=VISION)).float().eval()
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.ones(64)}, directory / "mtp.safetensors")
    return directory


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3.5", "qwen3.5-moe"])
def test_vision_language_release_serves_its_text_model(moe, tmp_path, caplog):
    path = write_vision_language(tmp_path, moe)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        llm = LLM(str(path), kv_cache_memory_gb=0.05)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert any("under model.visual." in line for line in skipped)
    assert any("2 checkpoint tensors under mtp." in line for line in skipped)
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt)


def test_llama4_release_serves_its_text_model(tmp_path, caplog):
    """A tiny `Llama4ForConditionalGeneration` (text model under `language_model.`, a vision
    tower and projector beside it): the text model's greedy tokens, the rest skipped by name."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from tests.checkpoints import _family_configs

    text = _family_configs(len(tokenizer()), tokenizer().eos_token_id)["llama4"].to_dict()
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
        pixel_shuffle_ratio=0.5,
    )
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)).float().eval()
    model.save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        llm = LLM(str(tmp_path), kv_cache_memory_gb=0.05, page_size=8)
    skipped = " ".join(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert "under vision_model." in skipped and "under multi_modal_projector." in skipped
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model.language_model, prompt)


def test_quantized_checkpoint_names_the_method(checkpoint_dir, tmp_path):
    quantized = tmp_path / "quantized"
    shutil.copytree(checkpoint_dir("llama"), quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="quantization method 'bitsandbytes' is not supported yet"):
        LLM(str(quantized))


@pytest.mark.parametrize("family", ["mixtral", "qwen3", "llama"])
def test_a_folder_without_tokenizer_files_runs_on_token_ids(family, checkpoint_dir, tmp_path):
    bare = tmp_path / family
    bare.mkdir()
    for file in checkpoint_dir(family).iterdir():
        if not file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(file, bare / file.name)
    llm = LLM(str(bare), kv_cache_memory_gb=0.05)
    assert llm.get_tokenizer() is None
    output = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 12
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
