"""GGUF checkpoints: the reader, the dequantizers, the tokenizer, and greedy parity with
transformers' own GGUF loading on a tiny Llama written here as llama.cpp writes one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kestrel import LLM, SamplingParams
from kestrel.weights.gguf_checkpoint import UnsupportedGgufError
from kestrel.weights.gguf_file import GgufFile, GgufFormatError
from tests.checkpoints import tokenizer

QuantType = gguf.GGMLQuantizationType
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
GLOBAL_NAMES = {"model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.mark.parametrize("quant_type", [QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1])
def test_torch_dequantizers_match_the_gguf_package(quant_type, tmp_path):
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("weight", gguf.quants.quantize(values, quant_type), raw_dtype=quant_type)
    writer.add_tensor("plain", values)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    file = GgufFile(path)
    info = file.tensors["weight"]
    assert info.shape == (8, 64) and info.quant_type == quant_type
    reference = gguf.quants.dequantize(gguf.quants.quantize(values, quant_type), quant_type)
    assert torch.equal(file.tensor("weight"), torch.from_numpy(reference))
    assert torch.equal(file.tensor("plain"), torch.from_numpy(values))
    assert (file.tensor("weight") - torch.from_numpy(values)).abs().max() < 0.3  # the quantization's own error


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(GgufFormatError, match="is not a GGUF file"):
        LLM(str(path))


def _interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q and k rows (its `permute`)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    backend = json.loads(tokenizer().backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in backend["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in backend["model"]["merges"]])
    writer.add_eos_token_id(tokenizer().eos_token_id)
    writer.add_chat_template(tokenizer().chat_template)


def write_tiny_llama_gguf(directory: Path, architecture: str = "llama") -> Path:
    """A 2-layer Llama in GGUF, its matrices in Q8_0 (embedding) and F16 (the rest), as llama.cpp
    converts one; `directory` also gets the HF config so transformers can load the same file."""
    config = LlamaConfig(
        vocab_size=len(tokenizer()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = directory / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(16)
    _add_tokenizer(writer)
    for name, tensor in model.state_dict().items():
        _add_weight(writer, name, tensor.numpy())
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def _add_weight(writer: gguf.GGUFWriter, name: str, weight: np.ndarray) -> None:
    if name == "model.embed_tokens.weight":
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(weight, QuantType.Q8_0), raw_dtype=QuantType.Q8_0)
        return
    if name in GLOBAL_NAMES:
        writer.add_tensor(GLOBAL_NAMES[name], weight)
        return
    layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
    if module == "self_attn.q_proj":
        weight = _interleave_rotary_rows(weight, 4)
    if module == "self_attn.k_proj":
        weight = _interleave_rotary_rows(weight, 2)
    if weight.ndim == 2:
        weight = weight.astype(np.float16)
    writer.add_tensor(f"blk.{layer}.{HF_TO_GGUF[module]}.weight", weight)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf"))


def test_tiny_gguf_greedy_matches_transformers_gguf_loading(tiny_gguf):
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_memory_gb=0.05)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, min_new_tokens=0
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected


def test_gguf_tokenizer_and_chat_template_match_the_original(tiny_gguf):
    llm = LLM(str(tiny_gguf.parent), kv_cache_memory_gb=0.05)  # a folder holding one GGUF file
    original, loaded = tokenizer(), llm.get_tokenizer()
    for text in ["Hello, world!", "  two  spaces\nand lines\t", "Café 東京 🙂 12345", "<|im_start|>user<|im_end|>"]:
        assert loaded.encode(text) == original.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    chat = [{"role": "user", "content": "Hi there"}]
    assert loaded.apply_chat_template(chat, add_generation_prompt=True) == original.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert original.eos_token_id in llm.engine.parts.eos_token_ids


def test_unsupported_gguf_architecture_and_ambiguous_folder_are_named(tiny_gguf, tmp_path):
    with pytest.raises(UnsupportedGgufError, match="GGUF architecture 'gemma' .* not supported; supported: llama"):
        LLM(str(write_tiny_llama_gguf(tmp_path, architecture="gemma")))
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(tiny_gguf, two / "a.gguf")
    shutil.copy(tiny_gguf, two / "b.gguf")
    with pytest.raises(FileNotFoundError, match="several GGUF files"):
        LLM(str(two))
