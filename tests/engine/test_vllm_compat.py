"""A copied vLLM `LLM(...)` call works, or says what it cannot do."""

from __future__ import annotations

import logging

import pytest

from kestrel import LLM, SamplingParams


def test_vllm_arguments_map_warn_or_refuse(checkpoint_dir, caplog):
    path = str(checkpoint_dir("qwen3"))
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        llm = LLM(
            path,
            block_size=8,
            trust_remote_code=True,
            swap_space=4,
            enable_chunked_prefill=True,
            tokenizer_mode="auto",
            kv_cache_memory_gb=0.05,
        )
    assert llm.engine.parts.kv.spec.page_size == 8
    warned = caplog.text
    assert "trust_remote_code=True has no effect" in warned and "swap_space=4 has no effect" in warned
    with pytest.raises(ValueError, match="quantization='marlin' is not supported yet"):
        LLM(path, quantization="marlin")
    with pytest.raises(ValueError, match="quantization='awq' names the checkpoint's own method, but .* unquantized"):
        LLM(path, quantization="awq")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported yet"):
        LLM(path, pipeline_parallel_size=2)
    with pytest.raises(TypeError, match="frobnicate"):
        LLM(path, frobnicate=1)


def test_chat_takes_a_template_its_kwargs_and_continues_a_message(checkpoint_dir):
    llm = LLM(str(checkpoint_dir("qwen3")), kv_cache_memory_gb=0.05)
    template = "{% for m in messages %}[{{ m.role }}|{{ mood }}]{{ m.content }}{% endfor %}"
    template += "{% if add_generation_prompt %}[assistant]{% endif %}"
    params = SamplingParams(max_tokens=2)
    chat = [{"role": "user", "content": "Hi"}]
    output = llm.chat(chat, params, use_tqdm=False, chat_template=template, chat_template_kwargs={"mood": "calm"})
    assert output[0].prompt == "[user|calm]Hi[assistant]"
    partial = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    continued = llm.chat(partial, params, use_tqdm=False, continue_final_message=True)[0]
    assert continued.prompt.endswith("Hello th")  # no end-of-turn, no new assistant turn
