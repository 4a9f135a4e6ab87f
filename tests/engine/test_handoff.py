"""Handing a prompt's state from one engine to another (disaggregated prefill and decode),
through the wire format, against one engine doing both."""

from __future__ import annotations

import io

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.transfer import decode_handle, encode_handle
from tests.checkpoints import FAMILIES
from tests.engine.test_prefix_caching import assert_same, random_tokens

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


def finish(llm: LLM) -> list:
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.finished]
    return outputs


def prefilled(prefill: LLM, prompt: list[int]):
    """The state of every prompt token but the last, as bytes for the wire."""
    prefill.engine.add_request("prefill", prompt[:-1], PARAMS, export_state=True)
    (output,) = finish(prefill)
    assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    return encode_handle(output.kv_state)


def decoded(decode: LLM, prompt: list[int], data: bytes, request_id: str = "decode"):
    decode.engine.add_request(request_id, prompt, PARAMS, imported_state=decode_handle(data, "test"))
    (output,) = finish(decode)
    return [(output.outputs[0].token_ids, [list(lp.items()) for lp in output.outputs[0].logprobs])]


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_from_another_engines_prefill_equals_one_engine(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    prefill, decode = LLM(path, page_size=8), LLM(path, page_size=8)
    alone = LLM(path, page_size=8, enable_prefix_caching=False)
    for length in (2, 9, 37):
        prompt = random_tokens(length, seed=length)
        expected = alone.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0].outputs[0]
        got = decoded(decode, prompt, prefilled(prefill, prompt))
        assert_same(got, [(expected.token_ids, [list(lp.items()) for lp in expected.logprobs])])
    for llm in (prefill, decode):
        stats = llm.engine.stats()
        assert stats.num_used_pages == 0 and stats.num_used_state_slots == 0


def test_state_that_does_not_fit_is_refused_by_name(checkpoint_dir):
    path = str(checkpoint_dir("llama"))
    prefill = LLM(path, page_size=8)
    prompt = random_tokens(20, seed=3)
    data = prefilled(prefill, prompt)
    decode = LLM(path, page_size=8)
    with pytest.raises(ValueError, match="tokenized it differently"):
        decode.engine.add_request("a", prompt + [1], PARAMS, imported_state=decode_handle(data, "test"))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        params = SamplingParams(max_tokens=2, prompt_logprobs=1)
        decode.engine.add_request("b", prompt, params, imported_state=decode_handle(data, "test"))
    other_pages = LLM(path, page_size=16)
    with pytest.raises(ValueError, match="state group 'kv'.*expected tensors"):
        other_pages.engine.add_request("c", prompt, PARAMS, imported_state=decode_handle(data, "test"))
    hybrid = LLM(str(checkpoint_dir("qwen3-next")), page_size=8)
    with pytest.raises(ValueError, match="state groups"):
        hybrid.engine.add_request("d", prompt, PARAMS, imported_state=decode_handle(data, "test"))
    assert not decode.engine.has_unfinished_requests() and not other_pages.engine.has_unfinished_requests()


def test_bytes_that_are_not_a_transfer_are_refused():
    with pytest.raises(ValueError, match="not a Kestrel state transfer"):
        decode_handle(b"not a transfer at all", "test")
    buffer = io.BytesIO()
    torch.save({"request_id": "x", "num_tokens": 1, "state": {"kv": ["text"]}}, buffer)
    with pytest.raises(ValueError, match="other than tensors"):
        decode_handle(buffer.getvalue(), "test")


def test_a_cpu_engine_cannot_keep_exports_on_a_gpu(checkpoint_dir):
    with pytest.raises(ValueError, match="kv_buffer_device='cuda' keeps exported state on the GPU; .* cpu"):
        LLM(str(checkpoint_dir("llama")), device="cpu", kv_buffer_device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="state exported to the GPU needs one")
@pytest.mark.parametrize("family", ["llama", "qwen3-next"])
def test_state_exported_to_the_gpu_decodes_like_one_engine(checkpoint_dir, family):
    """The prefill side of a CUDA IPC handoff: its state stays on the GPU, and decoding from
    it gives one engine's tokens (the IPC hop itself: tests/core/test_cuda_ipc.py)."""
    path = str(checkpoint_dir(family))
    options = dict(page_size=8, device="cuda", dtype="float32", kv_cache_memory_gb=0.25)
    prefill = LLM(path, kv_buffer_device="cuda", **options)
    decode, alone = LLM(path, **options), LLM(path, enable_prefix_caching=False, **options)
    for length in (2, 37):
        prompt = random_tokens(length, seed=length)
        expected = alone.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0].outputs[0]
        prefill.engine.add_request("prefill", prompt[:-1], PARAMS, export_state=True)
        (output,) = finish(prefill)
        tensors = [t for group in output.kv_state.state.values() for t in group]
        assert all(t.device.type == "cuda" for t in tensors)
        decode.engine.add_request("decode", prompt, PARAMS, imported_state=output.kv_state)
        (got,) = finish(decode)
        assert_same(
            [(got.outputs[0].token_ids, [list(lp.items()) for lp in got.outputs[0].logprobs])],
            [(expected.token_ids, [list(lp.items()) for lp in expected.logprobs])],
        )
