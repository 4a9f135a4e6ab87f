"""Every family's generation through the Triton branches a GPU takes (the Triton attention
backends, fused norms, rotary, q/k norms, gates, the MoE's routing and fused experts, the
gated-delta kernels) against the torch branches and the CPU attention backend, on the CPU
under Triton's interpreter: `core/kernel_branches.kernels_on_cpu` sends CPU tensors down the
branches `runs_kernels` chooses. The kernels have tests of their own (test_fused.py and
others); this checks the code around them, which otherwise runs only on a GPU (a partial
rotary computed out of place there was never written back, and Phi-3 decoded without rotary
on CUDA while every CPU test passed: with its branch chosen by `runs_kernels`, this test
fails on that code)."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.kernel_branches import kernels_on_cpu
from tests.checkpoints import FAMILIES

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the CUDA branches run natively on a GPU (test_hf_parity.py there)",
)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
PROMPTS = [{"prompt_token_ids": list(range(30, 41))}, {"prompt_token_ids": [7]}]
OPTIONS = dict(dtype="float32", page_size=16, kv_cache_memory_gb=0.02)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kernel_branches_compute_what_the_torch_branches_do(family, checkpoint_dir):
    path = str(checkpoint_dir(family))
    expected = LLM(path, **OPTIONS).generate(PROMPTS, PARAMS, use_tqdm=False)
    with kernels_on_cpu():
        llm = LLM(path, **OPTIONS)
        assert llm.engine.parts.runner.groups["kv"].binder.name.startswith("triton")
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a.keys() & b.keys())


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_float8_weights_take_the_kernels_the_cpu_path_mirrors(family, checkpoint_dir):
    """`--quantization fp8`: the float8 matmul (and the MoE's float8 experts) against the CPU
    path, which rounds each activation row through float8 as the kernel does. The kernel's
    output comes in bf16 (`torch._scaled_mm` with row-wise scales) where the CPU path keeps
    float32, so logprobs agree to that rounding (up to 0.2 nats measured here; with a float32
    output from the kernel, within 1e-6), not to float32's."""
    path = str(checkpoint_dir(family))
    expected = LLM(path, quantization="fp8", **OPTIONS).generate(PROMPTS, PARAMS, use_tqdm=False)
    with kernels_on_cpu():
        got = LLM(path, quantization="fp8", **OPTIONS).generate(PROMPTS, PARAMS, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 0.3 for t in a.keys() & b.keys())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_4bit_weights_take_the_kernels_that_multiply_by_their_dequantized_values(family, checkpoint_dir):
    """`--quantization int4` through the CUDA layout and kernels (groups of 128, the one-row
    matvec and the tiled matmul) against the same model whose weights are those 4-bit values
    dequantized, in float32."""
    from kestrel.layers.linear import Linear
    from kestrel.layers.quantized import Int4CudaWeight, dequantize_int4_cuda, int4_cuda_packable, quantize_int4_cuda

    path = str(checkpoint_dir(family))
    dequantized = LLM(path, **OPTIONS)
    with torch.no_grad():
        for module in dequantized.engine.parts.runner.model.modules():
            if isinstance(module, Linear) and module.quantizable and int4_cuda_packable(*module.weight.shape):
                module.weight.copy_(dequantize_int4_cuda(quantize_int4_cuda(module.weight)))
    expected = dequantized.generate(PROMPTS, PARAMS, use_tqdm=False)
    with kernels_on_cpu():
        llm = LLM(path, quantization="int4", **OPTIONS)
        modules = llm.engine.parts.runner.model.modules()
        packed = [m for m in modules if isinstance(getattr(m, "weight", None), Int4CudaWeight)]
        assert packed, "the model's linears of whole 128-column groups were meant to take the 4-bit layout"
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a.keys() & b.keys())


# Which layers fold at one row: all of them, or (DeepSeek-V2's group-limited routing, whose
# float32 scores read the normalised row) the dense ones, between which the residual stream
# is summed again. Hybrid layers do not fold (HybridDecoderLayer.folds).
FOLDED_LAYERS = {
    "llama": "all",
    "qwen3-moe": "all",
    "gpt-oss": "all",
    "deepseek-v2": "dense",
}


@pytest.mark.parametrize("family", FOLDED_LAYERS)
def test_one_row_steps_fold_each_norm_into_the_matvecs_that_read_it(family, checkpoint_dir, monkeypatch):
    """With every linear on the one-row matvec (as a GPU's measurement picks for these
    shapes; the CPU's own choice leaves some out), one-row steps run folded: each layer's
    norms inside the matvecs that read them, its residual adds inside those that write the
    sum (ResidualBlock.forward_folded). The layers expected fold at one row, none at two,
    each ran folded in every decode step, and the tokens and logprobs are the torch
    branches'."""
    from kestrel.layers.moe import SparseMoe
    from kestrel.models.dense import ResidualBlock

    path = str(checkpoint_dir(family))
    one_at_a_time = [[prompt] for prompt in PROMPTS]  # each step one row
    expected = [LLM(path, **OPTIONS).generate(prompt, PARAMS, use_tqdm=False)[0] for prompt in one_at_a_time]
    folded, unfolded = [], ResidualBlock.forward_folded
    monkeypatch.setattr(ResidualBlock, "forward_folded", lambda *args: folded.append(1) or unfolded(*args))
    with kernels_on_cpu():
        llm = LLM(path, **OPTIONS)
        modules = list(llm.engine.parts.runner.model.modules())
        for module in modules:
            if isinstance(getattr(module, "matvec_weight", None), torch.Tensor):
                module.use_gemv = True
        layers = [m for m in modules if isinstance(m, ResidualBlock)]
        hidden_size = layers[0].input_layernorm.weight.shape[0]
        folding = [m for m in layers if FOLDED_LAYERS[family] == "all" or not isinstance(m.mlp, SparseMoe)]
        assert [m for m in layers if m.folds(torch.zeros(1, hidden_size))] == folding
        assert not any(layer.folds(torch.zeros(2, hidden_size)) for layer in layers)
        got = [llm.generate(prompt, PARAMS, use_tqdm=False)[0] for prompt in one_at_a_time]
    assert folding and len(folded) >= len(folding) * (PARAMS.max_tokens - 1) * len(PROMPTS)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a.keys() & b.keys())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_row_steps_over_float8_weights_fold_their_norms_too(family, checkpoint_dir, monkeypatch):
    """`--quantization fp8` at one row: the float8 matvec takes each layer's norms, residual
    adds, rotary and activation as the bf16 one does (every layer runs folded), and the tokens
    and logprobs are the CPU path's (activations of one row unrounded there too)."""
    from kestrel.models.dense import ResidualBlock

    path = str(checkpoint_dir(family))
    one_at_a_time = [[prompt] for prompt in PROMPTS]
    quantized = OPTIONS | dict(quantization="fp8")
    expected = [LLM(path, **quantized).generate(prompt, PARAMS, use_tqdm=False)[0] for prompt in one_at_a_time]
    folded, unfolded = [], ResidualBlock.forward_folded
    monkeypatch.setattr(ResidualBlock, "forward_folded", lambda *args: folded.append(1) or unfolded(*args))
    with kernels_on_cpu():
        llm = LLM(path, **quantized)
        layers = [m for m in llm.engine.parts.runner.model.modules() if isinstance(m, ResidualBlock)]
        hidden_size = layers[0].input_layernorm.weight.shape[0]
        assert all(layer.folds(torch.zeros(1, hidden_size)) for layer in layers)
        got = [llm.generate(prompt, PARAMS, use_tqdm=False)[0] for prompt in one_at_a_time]
    assert len(folded) >= len(layers) * (PARAMS.max_tokens - 1) * len(PROMPTS)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a.keys() & b.keys())
