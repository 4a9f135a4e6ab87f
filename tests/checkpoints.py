"""Tiny random Hugging Face checkpoints for every supported family, written with save_pretrained."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from kestrel.demo import build_tokenizer

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    initializer_range=0.1,
)


# Linear-attention layers around a full-attention one; two value heads per key head.
HYBRID = dict(
    num_hidden_layers=3,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def _family_configs(vocab_size: int, eos: int) -> dict:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma3TextConfig,
        GptOssConfig,
        Llama4TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    base = dict(COMMON, vocab_size=vocab_size, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return {
        "llama": LlamaConfig(**base, num_key_value_heads=2, rope_scaling=llama3_rope),
        "llama-mqa-tied": LlamaConfig(**base, num_key_value_heads=1, tie_word_embeddings=True),
        "mistral": MistralConfig(**base, num_key_value_heads=2, sliding_window=48),
        "qwen2": Qwen2Config(**base, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**base, num_key_value_heads=2, head_dim=32),
        "qwen3-moe": Qwen3MoeConfig(
            **base,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        "mixtral": MixtralConfig(**base, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "qwen3-next": Qwen3NextConfig(
            **dict(base, **HYBRID),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,  # the routed experts' width: stacked with them
            norm_topk_prob=True,
            mlp_only_layers=[2],
        ),
        "qwen3.5": Qwen3_5TextConfig(**dict(base, **HYBRID)),
        # Sliding (window 8, local rope base) and global layers; prompts run past the window.
        "gemma3": Gemma3TextConfig(
            **dict(base, num_hidden_layers=3),
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            architectures=["Gemma3ForCausalLM"],
        ),
        # Phi-4-mini's shape: LongRoPE (every test prompt inside the pretraining length of 512,
        # where the short factors apply on both sides) on half of each head, tied embeddings.
        "phi3": Phi3Config(
            **base,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            original_max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.2, 1.6, 2.5],
                "long_factor": [1.0, 3.0, 6.0, 12.0],
                "original_max_position_embeddings": 512,
                "partial_rotary_factor": 0.5,
            },
        ),
        # GPT-OSS's shape, small: window and full layers in turn, sinks, biases, 4 of 8 experts.
        "gpt-oss": GptOssConfig(
            **dict(base, num_hidden_layers=3),
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=4,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        # Llama 4's shape, small: chunked rope layers (chunks of 8) and a full no-rope layer
        # with temperature tuning (its floor scaled down to act within the test's prompts), an
        # L2 qk norm, and a MoE every second layer (top-1 of 4, a shared expert beside).
        "llama4": Llama4TextConfig(
            **dict(base, num_hidden_layers=4),
            intermediate_size_mlp=96,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            architectures=["Llama4ForCausalLM"],
        ),
        # Multi-head latent attention without a query bottleneck (V2-Lite's shape), a dense
        # first layer, then 2 of 8 experts by softmax within the best 2 of 4 groups, 2 shared.
        "deepseek-v2": DeepseekV2Config(
            **dict(base, num_hidden_layers=3),
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
        # V3's shape: a query bottleneck, sigmoid routing with a correction bias over groups
        # ranked by their two best experts, renormalised weights, and YaRN with DeepSeek's
        # mscale (the scores' scale grows with it); prompts run past the pretraining length.
        "deepseek-v3": DeepseekV3Config(
            **dict(base, num_hidden_layers=3),
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    }


# Parameters transformers initializes to zero or not at all where a family's are trained to
# something else: random here, so the tests see them.
RANDOMIZED = {"gpt-oss": ("sinks", "bias"), "deepseek-v3": ("e_score_correction_bias",)}


FAMILIES = (
    "llama",
    "llama-mqa-tied",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3-moe",
    "mixtral",
    "qwen3-next",
    "qwen3.5",
    "gemma3",
    "phi3",
    "gpt-oss",
    "llama4",
    "deepseek-v2",
    "deepseek-v3",
)
HYBRID_FAMILIES = ("qwen3-next", "qwen3.5")


@lru_cache(maxsize=1)
def tokenizer():
    return build_tokenizer(vocab_size=512)


def write_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    config = _family_configs(len(tok), tok.eos_token_id)[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if any(part in name for part in RANDOMIZED.get(family, ())):
                tensor.copy_(torch.randn_like(tensor) * 0.5)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def add_mtp_head(source: Path, directory: Path, seed: int = 1) -> Path:
    """A copy of a hybrid checkpoint with a multi-token-prediction head (`mtp.*`), as Qwen3-Next
    releases carry one: transformers neither writes nor reads it. Its decoder layer starts as
    a copy of the checkpoint's full-attention layer; the rest is random."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    attention_layer = config["layer_types"].index("full_attention")
    prefix = f"model.layers.{attention_layer}."
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    for name, tensor in list(tensors.items()):
        if name.startswith(prefix):
            noise = 0.05 * torch.randn(tensor.shape, generator=generator)
            tensors["mtp.layers.0." + name.removeprefix(prefix)] = tensor + noise
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=generator)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def add_deepseek_mtp_layer(source: Path, directory: Path, seed: int = 1) -> Path:
    """A copy of a DeepSeek-V3 checkpoint with a multi-token-prediction layer appended after
    its decoder layers (`model.layers.<num_hidden_layers>.*`), as V3 releases carry one:
    transformers neither writes nor reads it. Its attention and MLP start as a copy of the last
    layer's; its own embeddings and LM head copy the model's; the norms and projection are random."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    last, head = config["num_hidden_layers"] - 1, f"model.layers.{config['num_hidden_layers']}."
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    for name, tensor in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            noise = 0.05 * torch.randn(tensor.shape, generator=generator)
            tensors[head + name.removeprefix(f"model.layers.{last}.")] = tensor + noise
    tensors[head + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[head + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[head + "eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{head}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


FP8_MAX = 448.0  # the largest float8 e4m3 value


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as FP8 releases store it: float8 e4m3 values and one float32 scale per block
    (`weight_scale_inv`, which multiplies the values back), each block's largest |value| at 448."""
    rows, columns = block
    out, inner = weight.shape
    padded = torch.zeros(-(-out // rows) * rows, -(-inner // columns) * columns)
    padded[:out, :inner] = weight.float()
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    values = (tiles / scale[:, None, :, None]).view_as(padded)[:out, :inner].to(torch.float8_e4m3fn)
    return values, scale


def write_fp8_checkpoint(source: Path, directory: Path, block: tuple[int, int] = (32, 32)) -> Path:
    """A copy of a checkpoint with every decoder projection in block-scaled FP8, its config
    saying so as transformers' FP8 releases do; embeddings, norms, routers and the LM head
    stay floats (`modules_to_not_convert`)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory, dirs_exist_ok=True)
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(path)
        for name, tensor in list(tensors.items()):
            if name.startswith("model.layers.") and name.endswith("proj.weight") and tensor.dim() == 2:
                tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = fp8_blocks(tensor, block)
        save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def pack_columns(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """codes [rows, n] -> int32 [rows, n / pack]: element i of each int32 (bits i*bits..) holds
    column order[i] of its group of `pack` (AutoAWQ's and AutoGPTQ's packing loops)."""
    pack = 32 // bits
    grouped = codes.reshape(codes.shape[0], -1, pack).long()
    if order is not None:
        grouped = grouped[:, :, list(order)]
    shifts = torch.arange(0, 32, bits)
    packed = (grouped << shifts).sum(dim=-1)  # disjoint bits: the sum is the bitwise or
    return (packed - (packed >= 2**31).long() * 2**32).to(torch.int32)  # as two's complement int32


def quantize_packed(
    weight: torch.Tensor, group_size: int, bits: int, symmetric: bool, groups_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes [in, out], integer zeros and float16 scales [groups, out] of a
    weight [out, in], each input column in group groups_of[column] (contiguous, or act-order)."""
    levels = 2**bits - 1
    w = weight.float().t()  # [in, out]
    groups = int(groups_of.max()) + 1
    scales, zeros = torch.empty(groups, w.shape[1]), torch.empty(groups, w.shape[1])
    for g in range(groups):
        rows = w[groups_of == g]
        if symmetric:  # GPTQ's sym: zero at the middle code
            scales[g] = (rows.abs().amax(0) / (levels // 2)).clamp(min=1e-6)
            zeros[g] = (levels + 1) // 2
        else:
            low, high = rows.amin(0), rows.amax(0)
            scales[g] = ((high - low) / levels).clamp(min=1e-6)
            zeros[g] = (-low / scales[g]).round().clamp(0, levels)
    scales = scales.half()
    scale, zero = scales.float()[groups_of], zeros[groups_of]
    codes = (w / scale + zero).round().clamp(0, levels).long()
    return codes, zeros.long(), scales


def write_packed_int_checkpoint(
    source: Path, directory: Path, reference: Path, method: str, group_size: int = 32, act_order: bool = False
) -> Path:
    """A copy of a checkpoint with every decoder projection packed as AWQ ("gemm", 4 bits,
    asymmetric) or GPTQ (AutoGPTQ's v1 format, 4 bits, symmetric; with `act_order`, columns
    in shuffled groups named by g_idx) store it; and, at `reference`, the same checkpoint with
    the float weights those codes mean: what loading the packed one must give exactly."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from kestrel.weights.packed_ints import AWQ_ORDER

    shutil.copytree(source, directory, dirs_exist_ok=True)
    shutil.copytree(source, reference, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(7)
    for path in sorted(directory.glob("*.safetensors")):
        packed, floats = {}, {}
        for name, tensor in load_file(path).items():
            if not (name.startswith("model.layers.") and name.endswith("proj.weight") and tensor.dim() == 2):
                packed[name] = floats[name] = tensor
                continue
            columns = tensor.shape[1]
            groups_of = torch.arange(columns) // group_size
            if act_order:
                groups_of = groups_of[torch.randperm(columns, generator=generator)]
            codes, zeros, scales = quantize_packed(tensor, group_size, 4, method == "gptq", groups_of)
            module = name.removesuffix(".weight")
            if method == "awq":
                packed[f"{module}.qweight"] = pack_columns(codes, 4, AWQ_ORDER)
                packed[f"{module}.qzeros"] = pack_columns(zeros, 4, AWQ_ORDER)
            else:  # codes packed along the input dim; zeros stored one below
                packed[f"{module}.qweight"] = pack_columns(codes.t(), 4).t().contiguous()
                packed[f"{module}.qzeros"] = pack_columns(zeros - 1, 4)
                packed[f"{module}.g_idx"] = groups_of.to(torch.int32)
            packed[f"{module}.scales"] = scales
            floats[name] = ((codes - zeros[groups_of]) * scales.float()[groups_of]).t().contiguous()
        save_file(packed, path, metadata={"format": "pt"})
        save_file(floats, reference / path.name, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "version": "gemm",
            "zero_point": True,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., rows, columns] -> MXFP4 (blocks [..., rows, columns / 32, 16], scales
    [..., rows, columns / 32]), each group of 32 scaled so its largest value is at most 6."""
    from kestrel.weights.mxfp4 import E2M1_VALUES, E8M0_BIAS

    groups = weight.float().unflatten(-1, (-1, 32))
    largest = groups.abs().amax(dim=-1).clamp(min=1e-30)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-E8M0_BIAS, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    table = torch.tensor(E2M1_VALUES[:8])
    magnitude = (scaled.abs()[..., None] - table).abs().argmin(dim=-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)  # [..., groups, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + E8M0_BIAS).to(torch.uint8)


def write_mxfp4_checkpoint(source: Path, directory: Path, reference: Path) -> Path:
    """A copy of a GPT-OSS checkpoint whose experts are stored as MXFP4, as the published ones
    are; and, at `reference`, the same checkpoint with those experts as the floats the codes mean."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from kestrel.weights.mxfp4 import dequantize

    for target in (directory, reference):
        shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    packed, floats = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = floats[name] = tensor
            continue
        blocks, scales = mxfp4_pack(tensor.transpose(1, 2))  # stored with output rows first
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        floats[name] = dequantize(blocks, scales, name)
    save_file(packed, directory / "model.safetensors")
    save_file(floats, reference / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
