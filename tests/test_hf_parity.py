"""Greedy tokens identical to Hugging Face `generate`, logprobs close, for every family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel import LLM, SamplingParams
from tests.checkpoints import FAMILIES, HYBRID_FAMILIES

PROMPT_LENGTHS = (1, 7, 33, 120, 200)
NEW_TOKENS = 32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Where a family needs what the Triton paged backend lacks: a latent pool (the MLA backend).
CUDA_BACKENDS = {"deepseek-v2": "triton_mla", "deepseek-v3": "triton_mla"}


def random_prompts(seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [score[0].log_softmax(-1) for score in out.scores]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_with_chunked_mixed_batches(family, device, checkpoint_dir):
    llm = assert_matches_hf(checkpoint_dir(family), device)
    if device == "cuda":  # the fast path: Triton kernels, decode replayed from CUDA graphs (hybrids too)
        backend = llm.engine.parts.runner.groups["kv"].binder
        assert backend.name == CUDA_BACKENDS.get(family, "triton")
        assert (llm.engine.parts.runner.graphs is not None) == backend.capabilities.cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the eager path differs from graphs on CUDA only")
@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next", "qwen3.5"])
def test_greedy_matches_hf_on_cuda_without_graphs(family, checkpoint_dir):
    llm = assert_matches_hf(checkpoint_dir(family), "cuda", enforce_eager=True)
    assert llm.engine.parts.runner.graphs is None


def assert_matches_hf(path, device: str, **engine_args) -> LLM:
    """HF's greedy tokens and logprobs within 1e-4 for prompts of 1 to 200 tokens. A 64-token
    budget splits the longer prompts over several steps while the short ones already decode,
    so prefill, decode and mixed steps all occur. Page size 16 lets CUDA pick the Triton
    backend; float32 keeps the comparison exact."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    prompts = random_prompts()
    llm = LLM(
        str(path),
        max_num_batched_tokens=64,
        page_size=16,
        dtype="float32",
        device=device,
        kv_cache_memory_gb=0.25,
        **engine_args,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected, scores = hf_greedy(hf, prompt)
        completion = output.outputs[0]
        assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens"
        for position, (token, score) in enumerate(zip(expected, scores)):
            assert completion.logprobs[position][token].logprob == pytest.approx(float(score[token]), abs=1e-4)
            assert completion.logprobs[position][token].rank == 1
    stats = llm.engine.stats()
    assert stats.num_used_pages == stats.num_used_state_slots == 0
    assert stats.num_free_pages + stats.num_cached_pages == stats.num_total_pages
    return llm


def test_prompt_logprobs_match_hf(checkpoint_dir):
    path = checkpoint_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = random_prompts(seed=5)[3]  # 120 tokens, prefilled in two chunks of 64
    llm = LLM(str(path), max_num_batched_tokens=64, page_size=8, dtype="float32", kv_cache_memory_gb=0.25)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(float(reference[position - 1, token]), abs=1e-4)
        top = reference[position - 1].topk(2).indices.tolist()
        assert set(top) <= set(entry)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", HYBRID_FAMILIES + ("gemma3", "qwen3-moe"))
def test_greedy_matches_hf_from_a_warm_prefix_cache(family, device, checkpoint_dir):
    """Prompts that share a 70-token prefix, run cold and then again from the cache, give HF's
    tokens both times: a hybrid model's cached prefix starts from a snapshot of its recurrent
    state; Gemma 3's window layers (8 tokens) share the pool with its global ones."""
    path = checkpoint_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 500, (70,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 500, (n,), generator=generator).tolist() for n in (1, 9, 40)]
    llm = LLM(
        str(path),
        max_num_batched_tokens=64,
        page_size=16,
        state_snapshot_interval=32,
        dtype="float32",
        device=device,
        kv_cache_memory_gb=0.25,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [hf_greedy(hf, prompt)[0] for prompt in prompts]
    for run in ("cold", "warm"):
        before = llm.engine.stats().prefix_cache_hits
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, run
        hits = llm.engine.stats().prefix_cache_hits - before
        # Warm, each prompt starts after the deepest kept state in its prefix: 64 of the 70
        # shared tokens, or 96 where a longer prompt of the cold pass kept one further on.
        assert hits >= (3 * 64 if run == "warm" else 0), run
    hybrid = family in HYBRID_FAMILIES
    assert (llm.engine.parts.kv.prefix_cache.num_snapshots > 0) == hybrid
