"""A GGUF file as a Hugging Face checkpoint: its config, its tensors under HF names, its tokenizer.

Weights are dequantized at load to the engine's dtype and bound through the recipe's strict
`WeightBindings`, exactly as a safetensors checkpoint's are.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from gguf import GGMLQuantizationType

from kestrel.weights.gguf_file import GgufFile

logger = logging.getLogger("kestrel")


class UnsupportedGgufError(ValueError):
    pass


@dataclass(frozen=True)
class GgufArchitecture:
    model_type: str  # transformers' config model_type
    architecture: str  # the HF class name Kestrel's recipe registry knows
    # llama.cpp's converter reorders llama-style q and k rows for its interleaved rotary
    # (`permute` in convert_hf_to_gguf.py); they are put back in HF's half-split order.
    interleaved_qk: bool


GGUF_ARCHITECTURES = {
    "llama": GgufArchitecture("llama", "LlamaForCausalLM", interleaved_qk=True),
    "qwen2": GgufArchitecture("qwen2", "Qwen2ForCausalLM", interleaved_qk=False),
    "qwen3": GgufArchitecture("qwen3", "Qwen3ForCausalLM", interleaved_qk=False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_architecture(file: GgufFile) -> GgufArchitecture:
    if file.architecture not in GGUF_ARCHITECTURES:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise UnsupportedGgufError(
            f"GGUF architecture {file.architecture!r} in {file.path.name} is not supported; supported: {known}"
        )
    return GGUF_ARCHITECTURES[file.architecture]


def hf_config(file: GgufFile) -> SimpleNamespace:
    """The config fields of the HF architecture that the GGUF metadata describes.

    A plain namespace with transformers' field names, not a transformers config object:
    building one imports 2.8 s of transformers modules, a third of this model's start-up.
    """
    arch = gguf_architecture(file)
    if "rope_freqs.weight" in file.tensors or file.arch_value("rope.scaling.type") not in (None, "none"):
        raise UnsupportedGgufError(f"{file.path.name}: GGUF rope scaling is not supported yet")
    num_heads = file.arch_value("attention.head_count")
    hidden_size = file.arch_value("embedding_length")
    embedding = file.tensors["token_embd.weight"]
    values = dict(
        architectures=[arch.architecture],
        vocab_size=embedding.shape[0],
        hidden_size=hidden_size,
        intermediate_size=file.arch_value("feed_forward_length"),
        num_hidden_layers=file.arch_value("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=file.arch_value("attention.head_count_kv", num_heads),
        head_dim=file.arch_value("attention.key_length", hidden_size // num_heads),
        rms_norm_eps=file.arch_value("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=file.arch_value("context_length", 4096),
        rope_parameters={"rope_type": "default", "rope_theta": float(file.arch_value("rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.metadata.get("tokenizer.ggml.eos_token_id"),
        # Quantized blocks carry no dtype; "auto" loads them as bf16 on GPUs (float32 on the CPU).
        dtype=torch.bfloat16,
        model_type=arch.model_type,
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in file.tensors,
    )
    return SimpleNamespace(**values)


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, name, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[name]}.{suffix}"
    return gguf_name  # left as it is: strict binding reports it as unexpected


def _half_split_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of rotary pairs (rows 0,1 -> rows 0, d/2)."""
    rows = tensor.shape[0]
    pairs = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return pairs.transpose(1, 2).reshape(tensor.shape)


def hf_tensors(file: GgufFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file under its Hugging Face name, in HF's layout."""
    arch = gguf_architecture(file)
    heads = {
        "attn_q": file.arch_value("attention.head_count"),
        "attn_k": file.arch_value("attention.head_count_kv", file.arch_value("attention.head_count")),
    }
    for name, tensor in file.iter_tensors():
        match = _LAYER_TENSOR.fullmatch(name)
        if arch.interleaved_qk and match and match.group(2) in heads:
            tensor = _half_split_rows(tensor, heads[match.group(2)])
        yield hf_name(name), tensor


# 4-bit GGML types whose groups of 32 `quantize_int4` holds: Q4_1's exactly (the same min-max
# grid), Q4_0's re-fitted to each group's own range.
_FOUR_BIT = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})


def stored_quantization(file: GgufFile) -> str | None:
    """ "int4" where most of the decoder's matrices are stored in 4 bits."""
    matrices = [info for name, info in file.tensors.items() if _LAYER_TENSOR.fullmatch(name) and len(info.shape) == 2]
    four_bit = sum(info.quant_type in _FOUR_BIT for info in matrices)
    return "int4" if matrices and 2 * four_bit > len(matrices) else None
