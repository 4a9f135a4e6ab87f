"""EngineArgs: what a user asks for. Resolved once into the engine's parts (engine/composition.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.engine.compilation import CompilationConfig
from kestrel.engine.reasoning import reasoning_format
from kestrel.engine.speculative import SpeculativeConfig

GIB = 1 << 30
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "none", "int4", "fp8", "awq", "gptq", "mxfp4")


@dataclass(frozen=True)
class EngineArgs:
    model: str
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # Quantization applied after loading (vLLM's name): "int4" (weight-only, 4-bit groups of 32,
    # the CPU), "fp8" (float8 e4m3 weights with a scale per row, activations per token), or
    # None / "none": the weights as loaded; "awq" / "gptq" / "mxfp4" name the checkpoint's own
    # method (loaded dequantized), as vLLM takes them.
    quantization: str | None = None
    # "auto" (the model's dtype) | "fp8" / "fp8_e4m3": keys and values stored as float8 e4m3,
    # which halves the bytes decode reads (and doubles the tokens the pool holds).
    kv_cache_dtype: str = "auto"
    # Linear-attention layers' recurrent matrices (vLLM's name): "auto" / "float32" keep them in
    # float32 as transformers does (the recurrence accumulates every token); "bfloat16" /
    # "float16" halve the state a decode step reads and writes per sequence (vLLM's "auto" is
    # the model's dtype: pass "bfloat16" for its behaviour). Computed in float32 either way.
    mamba_ssm_cache_dtype: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory_gb: float | None = None  # explicit KV budget; otherwise sized from free memory
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU this engine may fill
    page_size: int = 16
    seed: int = 0
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    attention_backend: str | None = None
    tokenizer: str | None = None  # defaults to the checkpoint's own
    revision: str | None = None  # a Hugging Face model id's branch, tag or commit
    enforce_eager: bool = False  # never capture CUDA graphs (nor compile CPU steps)
    # Compiled decode steps on the CPU (vLLM's name): a CompilationConfig, its dict or JSON
    # text ({"mode": 3, "compile_sizes": [1]}), or a bare mode (-O3). Eager by default.
    compilation_config: CompilationConfig | dict[str, Any] | str | int | None = None
    enable_prefix_caching: bool = True  # reuse the KV of prompt prefixes seen before
    # Hybrid models (linear-attention layers): their cached prefixes end where a copy of the
    # recurrent state was kept. Prefill chunks stop at every multiple of this many tokens
    # (a multiple of page_size) and the state there is kept, up to this many copies (None:
    # one per max_num_seqs). Each copy is one request's whole recurrent state.
    state_snapshot_interval: int = 512
    num_state_snapshots: int | None = None
    tensor_parallel_size: int = 1  # ranks the model is split across (one process each)
    distributed_executor_backend: str = "mp"  # "mp" (processes on this host) | "ray"
    # Plan and launch step N+1 before reading step N's samples, so host work overlaps the
    # device's. Steps that need every token on the host (penalties, prompt logprobs) still wait.
    async_scheduling: bool = True
    # Hopper and later GPUs: kernels start while the one before them finishes (dependent_launch.py).
    dependent_launch: bool = True
    # What preemption does with a request's state: "recompute" it later from the tokens, or
    # "swap" it to host memory and back (vLLM's name and values).
    preemption_mode: str = "recompute"
    # A host-memory tier behind the prefix cache, in GiB (vLLM's names): pages the device pool
    # evicts are kept there and copied back on a prefix hit. Backend: "native" (the only one).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # Where a prefill request's exported state waits for its decode instance (vLLM's
    # kv_buffer_device): "cpu", host memory, sent as bytes over TCP; "cuda", left on the GPU
    # for a decode process on the same host to copy through CUDA IPC (core/cuda_ipc.py).
    kv_buffer_device: str = "cpu"
    # A thinking model's reasoning markers (vLLM's names: "qwen3", "deepseek_r1"): structured
    # output grammars apply after the reasoning, and the server splits `reasoning_content` out.
    reasoning_parser: str | None = None
    # Speculative decoding, as vLLM spells it: a SpeculativeConfig, or its dict or JSON text
    # ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}); parsed here.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    def _offloading_checks(self) -> list[tuple[bool, str]]:
        size = self.kv_offloading_size
        return [
            (size is None or size > 0, f"kv_offloading_size must be positive (GiB), got {size}"),
            (
                self.kv_offloading_backend in (None, "native"),
                f"kv_offloading_backend={self.kv_offloading_backend!r} is not supported; supported: 'native'",
            ),
            (
                size is None or self.enable_prefix_caching,
                "kv_offloading_size keeps the prefix cache's evicted pages in host memory; "
                "it needs enable_prefix_caching",
            ),
            (
                size is None or self.tensor_parallel_size == 1,
                "kv_offloading_size keeps rank 0's pages only; it is not supported with tensor parallelism yet",
            ),
        ]

    def __post_init__(self) -> None:
        checks = [
            (
                self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
            ),
            (
                self.mamba_ssm_cache_dtype in SSM_CACHE_DTYPES,
                f"mamba_ssm_cache_dtype must be one of {', '.join(SSM_CACHE_DTYPES)}, "
                f"got {self.mamba_ssm_cache_dtype!r}",
            ),
            (
                self.quantization in QUANTIZATIONS,
                f"quantization={self.quantization!r} is not supported yet; supported: "
                + ", ".join(repr(q) for q in QUANTIZATIONS),
            ),
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}"),
            (self.page_size >= 1, f"page_size must be at least 1, got {self.page_size}"),
            (
                self.state_snapshot_interval >= 1 and self.state_snapshot_interval % max(self.page_size, 1) == 0,
                f"state_snapshot_interval must be a positive multiple of page_size ({self.page_size}), "
                f"got {self.state_snapshot_interval}",
            ),
            (
                self.num_state_snapshots is None or self.num_state_snapshots >= 0,
                f"num_state_snapshots must be at least 0, got {self.num_state_snapshots}",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 1,
                f"max_model_len must be at least 1, got {self.max_model_len}",
            ),
            (
                self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
            ),
            (
                self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
                f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}",
            ),
            (
                0 < self.gpu_memory_utilization <= 1,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (
                self.tensor_parallel_size >= 1,
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}",
            ),
            (
                self.distributed_executor_backend in ("mp", "ray"),
                f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}",
            ),
            (
                self.preemption_mode in ("recompute", "swap"),
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}",
            ),
            (
                self.preemption_mode != "swap" or self.tensor_parallel_size == 1,
                "preemption_mode='swap' swaps rank 0's state only; with tensor parallelism use 'recompute'",
            ),
            (
                self.kv_buffer_device in ("cpu", "cuda"),
                f"kv_buffer_device must be 'cpu' or 'cuda', got {self.kv_buffer_device!r}",
            ),
            *self._offloading_checks(),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        compilation = CompilationConfig.parse(self.compilation_config or CompilationConfig())
        object.__setattr__(self, "compilation_config", compilation)
        if self.reasoning_parser is not None:
            reasoning_format(self.reasoning_parser)  # an unknown name fails here, naming the known ones
