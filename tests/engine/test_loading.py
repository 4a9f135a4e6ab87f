"""Checkpoint formats: sharded safetensors, dtype casts, dummy weights of a named shape."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel import LLM, SamplingParams
from kestrel.models.dummy_configs import DUMMY_CONFIGS, dummy_hf_config
from kestrel.models.registry import recipe_for
from tests.checkpoints import tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPT = {"prompt_token_ids": list(range(3, 40))}


def test_sharded_checkpoint_gives_the_same_tokens(checkpoint_dir, tmp_path):
    source = checkpoint_dir("qwen2")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    tokenizer().save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = LLM(str(tmp_path)).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    single = LLM(str(source)).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert sharded == single


def test_bfloat16_cast_stays_close_to_float32(checkpoint_dir):
    path = str(checkpoint_dir("llama"))
    full = LLM(path, dtype="float32").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    half = LLM(path, dtype="bfloat16").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert half.token_ids[0] == full.token_ids[0]
    first = full.token_ids[0]
    assert half.logprobs[0][first].logprob == pytest.approx(full.logprobs[0][first].logprob, abs=0.1)


def test_dummy_weights_of_a_named_shape_need_no_checkpoint():
    llm = LLM("qwen3-60m", load_format="dummy", max_model_len=256, kv_cache_memory_gb=0.05)
    spec = llm.engine.parts.spec
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size) == (512, 8, 64000)
    assert llm.get_tokenizer() is None
    output = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_the_log_says_how_many_longest_requests_the_kv_pool_holds(caplog):
    """vLLM's "maximum concurrency" line: what an operator sizing max_num_seqs reads."""
    with caplog.at_level("INFO", logger="kestrel"):
        llm = LLM("qwen3-60m", load_format="dummy", max_model_len=256, kv_cache_memory_gb=0.05)
    tokens = llm.engine.parts.kv.capacity_tokens
    expected = f"KV pool: {tokens} tokens; maximum concurrency at 256 tokens per request: {tokens / 256:.2f}x"
    assert expected in caplog.text


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_every_named_shape_reads_as_its_recipe_expects(name):
    config = dummy_hf_config(name)
    spec = recipe_for(config.architectures).spec(config)
    assert spec.num_layers == config.num_hidden_layers and spec.vocab_size == config.vocab_size
    if name == "deepseek-v2-lite":  # one 576-dim latent per token and layer, not 16 heads' keys and values
        (layer,) = {layer.for_rank() for layer in spec.attention_layers()}
        assert (layer.num_kv_heads, layer.head_dim, layer.latent_dim) == (1, 576, 512)
        kv = spec.state_groups(torch.bfloat16, torch.bfloat16, 16)["kv"].kv
        assert kv.bytes_per_page() // 16 == 27 * 576 * 2


def test_unsupported_dtype_is_a_clear_error(checkpoint_dir):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(str(checkpoint_dir("llama")), dtype="float8")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in"),
        ("kv_cache_memory_gb", 0, "kv_cache_memory_gb must be positive"),
        ("max_num_seqs", 0, "max_num_seqs must be at least 1"),
        ("page_size", 0, "page_size must be at least 1"),
    ],
)
def test_invalid_engine_options_name_the_option(checkpoint_dir, field, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoint_dir("llama")), **{field: value})


@pytest.mark.parametrize(
    "name, field, value, message",
    [
        ("deepseek-v2-lite", "scoring_func", "sigmoid", "scoring_func 'sigmoid' is not supported"),
        ("deepseek-v2-lite", "topk_method", "noaux_tc", "topk_method 'noaux_tc' is not supported"),
        ("deepseek-v2-lite", "attention_bias", True, "with attention_bias and no q_lora_rank is not supported"),
    ],
)
def test_a_deepseek_layout_kestrel_does_not_run_is_refused_by_name(name, field, value, message):
    config = dummy_hf_config(name)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        recipe_for(config.architectures).spec(config)
