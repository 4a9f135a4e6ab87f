"""The composition root: resolve `EngineArgs` once into the engine's parts: runtime, model, KV pool, backend, runner."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kestrel.config import GIB, EngineArgs
from kestrel.core.attention.base import AttentionBackend, AttentionLayerSpec, BackendRequirements
from kestrel.core.attention.registry import select_backend
from kestrel.core.batch import KV_GROUP
from kestrel.core.binder import StepBinder
from kestrel.core.decode_graphs import DecodeGraphs, check_compiles, decode_buckets, graphs_supported
from kestrel.core.host_tier import HostKVTier
from kestrel.core.layer_spec import PoolBudget, RecurrentGroup, StateGroupSpec
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.planner import FcfsPlanner, PlannerConfig
from kestrel.core.recipe import ModelSpec
from kestrel.core.recurrent_state import RECURRENT_GROUP, RecurrentStateProvider
from kestrel.core.runner import ModelRunner
from kestrel.core.runtime import DeviceRuntime, create_runtime
from kestrel.core.runtime.cpu_kernels import choose_cpu_matvecs
from kestrel.core.runtime.dependent_launch import configure as configure_dependent_launch
from kestrel.core.state import KVCacheSpec, PagedKVProvider, StateGroup, StateProvider
from kestrel.core.warm_up import warm_up
from kestrel.core.workspace import Workspace
from kestrel.distributed.executor import LocalExecutor, MultiprocessExecutor, TensorParallelExecutor, start_workers
from kestrel.distributed.group import GroupAddress, join_group, rank_args
from kestrel.layers.quantized import quantize_linears
from kestrel.logs import log_duration
from kestrel.models.dummy_configs import DUMMY_CONFIGS, dummy_hf_config
from kestrel.models.registry import mtp_recipe_for, recipe_for
from kestrel.weights.checkpoint import Checkpoint, CheckpointNotFoundError, load_tokenizer_from, open_checkpoint
from kestrel.weights.loader import load_model

logger = logging.getLogger("kestrel")

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float": torch.float32,
}
CPU_DEFAULT_KV_BYTES = 1 * GIB
CUDA_MEMORY_MARGIN = GIB // 2  # past the measured peak: the graph pool, fragmentation
MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound: launch overhead no longer matters


@dataclass(frozen=True)
class EngineParts:
    args: EngineArgs
    runtime: DeviceRuntime
    spec: ModelSpec
    dtype: torch.dtype
    quantization: str | None  # the weight-only quantization applied after loading
    kv: PagedKVProvider
    recurrent: RecurrentStateProvider | None  # hybrid models' linear-attention state slots
    groups: Mapping[str, StateGroup]  # every state group, the two above among them
    runner: ModelRunner  # rank 0's
    executor: LocalExecutor | TensorParallelExecutor  # runs each step on every rank
    planner: FcfsPlanner
    tokenizer: Any | None
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int]
    draft: RankParts | None = None  # speculative decoding's draft model: its own pool and runner


def open_model(args: EngineArgs) -> tuple[Any, Checkpoint | None]:
    """The model's HF config, and its checkpoint (None for a built-in dummy shape)."""
    if args.load_format == "dummy" and args.model in DUMMY_CONFIGS and not Path(args.model).exists():
        return dummy_hf_config(args.model), None
    try:
        checkpoint = open_checkpoint(args.model, args.revision)
    except CheckpointNotFoundError as error:
        if args.load_format != "dummy":
            raise
        known = ", ".join(sorted(DUMMY_CONFIGS))
        raise CheckpointNotFoundError(f"{error} (with load_format='dummy', a built-in shape: {known})") from None
    if args.load_format in ("safetensors", "gguf") and checkpoint.format != args.load_format:
        raise ValueError(
            f"load_format {args.load_format!r} was asked for, but {checkpoint.path} is {checkpoint.format}"
        )
    return checkpoint.hf_config(), checkpoint


def resolve_dtype(name: str, hf_config: Any, runtime: DeviceRuntime) -> torch.dtype:
    if name == "auto":
        if runtime.name == "cpu":
            return torch.float32  # half-precision matmuls are slow on most CPUs
        checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else runtime.default_dtype()
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16")
    runtime.check_dtype(DTYPES[name])
    return DTYPES[name]


def resolve_quantization(name: str | None, checkpoint: Checkpoint | None, runtime: DeviceRuntime) -> str | None:
    """The weight-only quantization to apply after loading, or None.

    Not on by itself for a 4-bit GGUF: bf16's rounding inside the 4-bit kernel moves logprobs
    by about 0.02 nats, enough to flip a near tie (the demo model's first answer)."""
    if name is None or name == "none":
        stored = checkpoint.stored_quantization() if checkpoint is not None else None
        if name is None and stored is not None and runtime.name == "cpu":
            logger.info(
                "%s stores %s weights; --quantization %s keeps them so (faster decode)", checkpoint.path, stored, stored
            )
        return None
    if name in CHECKPOINT_METHODS:  # vLLM's way of naming the checkpoint's own method
        stored = checkpoint_quant_method(checkpoint)
        if stored != name:
            where = checkpoint.path if checkpoint is not None else "load_format='dummy'"
            raise ValueError(
                f"quantization={name!r} names the checkpoint's own method, but {where} stores "
                f"{repr(stored) + ' weights' if stored else 'unquantized weights'}"
            )
        return None
    return name


# Methods a checkpoint stores (loaded dequantized); `quantization=` may name them, as vLLM allows.
CHECKPOINT_METHODS = ("awq", "gptq", "mxfp4")


def checkpoint_quant_method(checkpoint: Checkpoint | None) -> str | None:
    """The `quant_method` a Hugging Face checkpoint's config declares, or None."""
    config = getattr(checkpoint.hf_config(), "quantization_config", None) if checkpoint is not None else None
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(getattr(method, "value", method)).lower() if method else None


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool stores: the model's, or float8 e4m3 for "fp8" (vLLM's names;
    values are cast unscaled, as vLLM does without checkpoint scales)."""
    return dtype if name == "auto" else torch.float8_e4m3fn


def kv_budget_bytes(args: EngineArgs, runtime: DeviceRuntime, profile: Callable[[], int]) -> int:
    """The explicit budget; on the CPU a default share of free memory; on a GPU what
    `gpu_memory_utilization` leaves after the weights and the peak of a profiling forward."""
    if args.kv_cache_memory_gb is not None:
        return int(args.kv_cache_memory_gb * GIB)
    if runtime.name == "cpu":
        return min(CPU_DEFAULT_KV_BYTES, runtime.memory_info().free_bytes // 4)
    activations = profile()
    memory = runtime.memory_info()
    used = memory.total_bytes - memory.free_bytes
    budget = int(memory.total_bytes * args.gpu_memory_utilization) - used - activations - CUDA_MEMORY_MARGIN
    logger.info("profiling forward: %.2f GiB of activations at the largest step", activations / GIB)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {memory.free_bytes / GIB:.1f} GiB free of "
            f"{memory.total_bytes / GIB:.1f} GiB after loading the model, and the largest step needs "
            f"{activations / GIB:.1f} GiB; lower max_num_batched_tokens, free the GPU or set kv_cache_memory_gb"
        )
    return budget


def profile_activation_bytes(
    model: torch.nn.Module,
    backend_cls: type[AttentionBackend],
    kv_spec: KVCacheSpec,
    runtime: DeviceRuntime,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_seq_len: int,
    layer: AttentionLayerSpec,
    fixed: dict[str, StateProvider],
) -> int:
    """Peak memory of the largest steps, run on a provisional pool just big enough for them."""
    # Each prefill sequence may end on a partly filled page; the decode step runs after those
    # pages are released and needs one page per sequence.
    pages = -(-max_num_batched_tokens // kv_spec.page_size) + max_num_seqs
    kv = PagedKVProvider(kv_spec, pages * kv_spec.bytes_per_page(), runtime.device)
    workspace = Workspace(runtime.device)
    groups = state_groups(kv, backend_cls, layer, fixed, workspace, max_num_seqs)
    runner = ModelRunner(model, groups, runtime, workspace, max_num_batched_tokens)
    return runtime.peak_bytes_during(lambda: warm_up(runner, max_num_batched_tokens, max_num_seqs, max_seq_len))


def state_groups(
    kv: PagedKVProvider,
    backend_cls: type[AttentionBackend],
    layer: AttentionLayerSpec,
    fixed: dict[str, StateProvider],
    workspace: Workspace,
    max_num_seqs: int,
) -> dict[str, StateGroup]:
    """The KV pool read by its attention backend (whose persistent buffers come from the
    workspace now), and every fixed-size pool, binding itself where it is a `StepBinder`."""
    backend = backend_cls(kv.layer(0).key.device, kv.spec.page_size)
    backend.allocate(workspace, max_num_seqs, layer)
    groups = {KV_GROUP: StateGroup(KV_GROUP, kv, backend)}
    for name, provider in fixed.items():
        if not isinstance(provider, StepBinder):
            raise ValueError(f"state group {name!r} has no binder for its per-step metadata")
        groups[name] = StateGroup(name, provider, provider)
    return groups


def split_state_groups(
    spec: ModelSpec, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, parallel: TensorParallel
) -> tuple[KVCacheSpec, dict[str, StateGroupSpec]]:
    """The KV group's spec, and the fixed-size groups (one unit per sequence), from the
    recipe's layer specs."""
    groups = spec.state_groups(dtype, kv_dtype, page_size, parallel)
    paged = {name: group for name, group in groups.items() if group.paged}
    if set(paged) != {KV_GROUP}:
        raise ValueError(
            f"{spec.architecture}: paged state groups {sorted(paged)}; the engine pools the {KV_GROUP!r} group "
            "alone so far (a model needs full-attention layers, and further paged groups are not pooled yet)"
        )
    return paged[KV_GROUP].kv, {name: group for name, group in groups.items() if not group.paged}


def recurrent_state_dtype(name: str) -> torch.dtype:
    """`mamba_ssm_cache_dtype` as a dtype: "auto" keeps float32, as transformers does."""
    return torch.float32 if name == "auto" else DTYPES[name]


def with_recurrent_state_dtype(groups: dict[str, StateGroupSpec], dtype: torch.dtype) -> dict[str, StateGroupSpec]:
    """The fixed-size groups, their linear-attention state matrices stored in `dtype`."""
    return {
        name: dataclasses.replace(group, recurrent=dataclasses.replace(group.recurrent, state_dtype=dtype))
        if isinstance(group, RecurrentGroup)
        else group
        for name, group in groups.items()
    }


def build_fixed_pools(
    groups: dict[str, StateGroupSpec],
    max_num_seqs: int,
    num_snapshots: int,
    device: torch.device,
    replacing: dict[str, StateProvider] | None = None,
) -> dict[str, StateProvider]:
    """One unit per request that may run at once (linear-attention state slots), and the
    copies of those units the prefix cache may keep. `replacing`: pools built before, freed
    first (they held no request)."""
    if replacing:
        replacing.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        name: group.build(PoolBudget(0, max_num_seqs, device, num_snapshots=num_snapshots))
        for name, group in groups.items()
    }


def log_fixed_pools(groups: dict[str, StateGroupSpec], units: int, snapshots: int, args: EngineArgs) -> None:
    for name, group in groups.items():
        size = group.bytes_per_unit() / (1 << 20)
        logger.info("state group %s: %d units and %d snapshots of %.1f MiB", name, units, snapshots, size)
    if args.enable_prefix_caching and groups and not snapshots and args.num_state_snapshots is None:
        logger.warning(
            "prefix caching is off for this model: no copy of its recurrent state fits %s of the KV budget "
            "(set num_state_snapshots to keep some)",
            f"1/{round(1 / SNAPSHOT_SHARE_OF_KV)}",
        )


# By default the prefix cache's state snapshots take at most this share of the memory the KV
# pool would otherwise get: a large hybrid model's state is tens of MB per copy (Qwen3-Next-80B:
# 75 MB in float32), and one copy per request that may run at once took almost a third of an H100's
# KV and state memory in a throughput run (Qwen3-Next, 512 sequences) whose prompts shared nothing.
SNAPSHOT_SHARE_OF_KV = 1 / 8


def num_state_snapshots(args: EngineArgs, fixed_specs: dict[str, StateGroupSpec], kv_budget: int) -> int:
    """Copies of the recurrent state kept for the prefix cache: none without caching or
    without fixed-size state; as asked; else one per request that may run at once, as far as
    `SNAPSHOT_SHARE_OF_KV` of the KV budget holds them."""
    if not args.enable_prefix_caching or not fixed_specs:
        return 0
    if args.num_state_snapshots is not None:
        return args.num_state_snapshots
    return min(args.max_num_seqs, int(kv_budget * SNAPSHOT_SHARE_OF_KV) // unit_bytes(fixed_specs))


def unit_bytes(fixed_specs: dict[str, StateGroupSpec]) -> int:
    """The bytes of one unit (a slot or a snapshot) of every fixed-size state group."""
    return sum(spec.bytes_per_unit() for spec in fixed_specs.values())


def resolve_max_model_len(args: EngineArgs, spec: ModelSpec, kv: PagedKVProvider) -> int:
    limit = spec.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > limit:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's max_position_embeddings {limit}")
        if args.max_model_len > kv.capacity_tokens:
            raise ValueError(
                f"max_model_len {args.max_model_len} does not fit the KV cache ({kv.capacity_tokens} tokens); "
                "raise kv_cache_memory_gb or lower max_model_len"
            )
        return args.max_model_len
    if kv.capacity_tokens < limit:
        logger.warning("max_model_len lowered to %d, the KV cache's capacity", kv.capacity_tokens)
    return min(limit, kv.capacity_tokens)


def load_tokenizer(args: EngineArgs, checkpoint: Checkpoint | None) -> Any | None:
    """The tokenizer asked for, else the checkpoint's; None where there is none (token ids only)."""
    if args.tokenizer is not None:
        return load_tokenizer_from(args.tokenizer)
    return None if checkpoint is None else checkpoint.tokenizer()


def eos_token_ids(spec: ModelSpec, tokenizer: Any | None, checkpoint: Checkpoint | None) -> frozenset[int]:
    ids = set(spec.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if checkpoint is not None:
        ids.update(checkpoint.eos_token_ids())
    return frozenset(ids)


@dataclass(frozen=True)
class RankParts:
    """What every tensor-parallel rank builds for itself: its shard of the model, its state
    pools (same page count on every rank) and the runner over them."""

    runtime: DeviceRuntime
    spec: ModelSpec
    dtype: torch.dtype
    quantization: str | None
    kv: PagedKVProvider
    recurrent: RecurrentStateProvider | None
    runner: ModelRunner
    max_model_len: int
    max_num_batched_tokens: int
    checkpoint: Checkpoint | None


@dataclass(frozen=True)
class LoadedModel:
    """A rank's model with its weights loaded, and what its state pools will be: the first
    half of building a rank, before the KV budget is known."""

    runtime: DeviceRuntime
    spec: ModelSpec
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str | None
    model: torch.nn.Module
    checkpoint: Checkpoint | None
    backend_cls: type[AttentionBackend]
    layer: AttentionLayerSpec  # this rank's attention layer shape, for the backend's buffers
    kv_spec: KVCacheSpec
    fixed_specs: dict[str, StateGroupSpec]
    max_num_batched_tokens: int

    def kv_bytes_per_token(self) -> float:
        return self.kv_spec.bytes_per_page() / self.kv_spec.page_size


def load_rank_model(args: EngineArgs, parallel: TensorParallel, mtp_head: bool = False) -> LoadedModel:
    """`mtp_head`: load the checkpoint's multi-token-prediction head instead of the model."""
    runtime = create_runtime(args.device)
    runtime.configure_process()
    configure_dependent_launch(args.dependent_launch)
    hf_config, checkpoint = open_model(args)
    architectures = getattr(hf_config, "architectures", None)
    recipe = mtp_recipe_for(architectures) if mtp_head else recipe_for(architectures)
    spec = recipe.spec(hf_config)
    dtype = resolve_dtype(args.dtype, hf_config, runtime)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    attention = spec.attention_layers()
    if not attention:
        raise ValueError(f"{spec.architecture} has no attention layer; the engine needs a KV group")
    windowed = any(layer.sliding_window is not None for layer in attention)
    sinks = any(layer.sinks for layer in attention)
    chunked = any(layer.chunk_size is not None for layer in attention)
    latent = any(layer.latent_dim is not None for layer in attention)
    needs = BackendRequirements(
        runtime.name, dtype, attention[0].head_dim, windowed, args.page_size, kv_dtype, sinks, chunked, latent
    )
    backend_cls = select_backend(
        needs,
        args.attention_backend,
    )
    with log_duration(logger, f"loading {spec.architecture} weights ({args.load_format}) from {args.model}"):
        model = load_model(recipe, spec, checkpoint, runtime.device, dtype, args.load_format, args.seed, parallel)
    quantization = resolve_quantization(args.quantization, checkpoint, runtime)
    if quantization is not None:
        with log_duration(logger, f"packing the decoder's weights ({quantization})"):
            quantize_linears(model, quantization)
    default_batch_tokens = 2048 if runtime.name == "cpu" else 8192
    kv_spec, fixed_specs = split_state_groups(spec, dtype, kv_dtype, args.page_size, parallel)
    fixed_specs = with_recurrent_state_dtype(fixed_specs, recurrent_state_dtype(args.mamba_ssm_cache_dtype))
    if args.mamba_ssm_cache_dtype != "auto" and not any(isinstance(g, RecurrentGroup) for g in fixed_specs.values()):
        logger.warning(
            "mamba_ssm_cache_dtype=%r has no effect: %s keeps no recurrent state",
            args.mamba_ssm_cache_dtype,
            spec.architecture,
        )
    return LoadedModel(
        runtime,
        spec,
        dtype,
        kv_dtype,
        quantization,
        model,
        checkpoint,
        backend_cls,
        attention[0].for_rank(parallel),
        kv_spec,
        fixed_specs,
        args.max_num_batched_tokens or default_batch_tokens,
    )


def build_rank(
    args: EngineArgs, parallel: TensorParallel, loaded: LoadedModel | None = None, kv_share: float = 1.0
) -> RankParts:
    """A rank: its loaded model (`loaded`, or loaded now), pools and runner. `kv_share`: the
    part of the KV budget this model's pool takes (a draft model's pool takes the rest)."""
    loaded = loaded or load_rank_model(args, parallel)
    runtime, model, backend_cls, layer = loaded.runtime, loaded.model, loaded.backend_cls, loaded.layer
    kv_spec, max_num_batched_tokens = loaded.kv_spec, loaded.max_num_batched_tokens
    longest = args.max_model_len or loaded.spec.max_position_embeddings
    fixed_specs = loaded.fixed_specs
    # Speculative decoding: a spare slot per request, where a verify chunk's state goes.
    slots = args.max_num_seqs * (2 if args.speculative_config is not None else 1)
    fixed = build_fixed_pools(fixed_specs, slots, 0, runtime.device)

    def profile() -> int:
        return profile_activation_bytes(
            model, backend_cls, kv_spec, runtime, max_num_batched_tokens, args.max_num_seqs, longest, layer, fixed
        )

    # Every rank must hold the same number of pages: the smallest budget of any rank.
    budget = parallel.min_across_ranks(int(kv_budget_bytes(args, runtime, profile) * kv_share), runtime.device)
    snapshots = num_state_snapshots(args, fixed_specs, budget)
    if snapshots:  # the pools again, with their snapshots, out of the KV budget where it was measured
        fixed = build_fixed_pools(fixed_specs, slots, snapshots, runtime.device, replacing=fixed)
        if args.kv_cache_memory_gb is None:
            budget -= snapshots * unit_bytes(fixed_specs)
    log_fixed_pools(fixed_specs, slots, snapshots, args)
    recurrent = fixed.get(RECURRENT_GROUP)
    kv = PagedKVProvider(
        kv_spec,
        budget,
        runtime.device,
        # A hybrid model's cached prefix is usable only with a copy of its recurrent state.
        enable_prefix_caching=args.enable_prefix_caching and (recurrent is None or recurrent.num_snapshots > 0),
        layout=backend_cls.kv_layout(loaded.kv_dtype),
    )
    logger.info(
        "KV pool: %d pages of %d tokens (%s), %.2f GiB; attention backend %s",
        kv.num_pages,
        args.page_size,
        str(loaded.kv_dtype).removeprefix("torch."),
        kv.num_pages * kv_spec.bytes_per_page() / GIB,
        backend_cls.name,
    )
    if recurrent is not None and kv.prefix_cache is not None:
        kv.prefix_cache.on_snapshot_dropped = recurrent.free_snapshot
    max_model_len = resolve_max_model_len(args, loaded.spec, kv)
    # As vLLM reports it: how many requests of the longest length the pool holds at once.
    logger.info(
        "KV pool: %d tokens; maximum concurrency at %d tokens per request: %.2fx",
        kv.capacity_tokens,
        max_model_len,
        kv.capacity_tokens / max_model_len,
    )
    runner = build_runner(args, loaded, kv, fixed, max_model_len, sampling=parallel.rank == 0, parallel=parallel)
    return RankParts(
        runtime,
        loaded.spec,
        loaded.dtype,
        loaded.quantization,
        kv,
        recurrent,
        runner,
        max_model_len,
        max_num_batched_tokens,
        loaded.checkpoint,
    )


def build_runner(
    args: EngineArgs,
    loaded: LoadedModel,
    kv: PagedKVProvider,
    fixed: dict[str, StateProvider],
    max_model_len: int,
    sampling: bool,
    parallel: TensorParallel,
) -> ModelRunner:
    """The runner over the rank's pools, its CUDA graphs captured and its kernels warmed up."""
    runtime, model = loaded.runtime, loaded.model
    if runtime.name == "cuda":
        from kestrel.layers.gemv import choose_matvec_kernels  # Triton kernels: CUDA only

        with log_duration(logger, "choosing the one-row matvec kernel per weight shape"):
            choose_matvec_kernels(model)
    elif runtime.name == "cpu":
        choose_cpu_matvecs(model)
    workspace = Workspace(runtime.device)
    groups = state_groups(kv, loaded.backend_cls, loaded.layer, fixed, workspace, args.max_num_seqs)
    graphs = None
    buckets = graph_buckets(args, runtime)
    if buckets and not runtime.graphs_by_default:
        check_compiles(groups)
    if buckets and graphs_supported(groups):
        graphs = DecodeGraphs(model, groups, workspace, runtime, buckets, -(-max_model_len // args.page_size))
        what = "capturing CUDA graphs" if runtime.name == "cuda" else f"compiling decode steps of {buckets} rows"
        with log_duration(logger, what):
            graphs.capture()
    batch_tokens = loaded.max_num_batched_tokens
    runner = ModelRunner(model, groups, runtime, workspace, batch_tokens, graphs, sampling, parallel)
    with log_duration(logger, "warm-up"):
        tokens, seqs = runtime.warm_up_size(batch_tokens, args.max_num_seqs)
        warm_up(runner, tokens, seqs, max_model_len, runtime.warm_up_smaller_prefills(tokens))
    return runner


def graph_buckets(args: EngineArgs, runtime: DeviceRuntime) -> list[int]:
    """The decode batch sizes captured as graphs: every bucket on CUDA unless eager is asked
    for; on the CPU, the sizes `compilation_config` compiles, if it asks."""
    if args.compilation_config.compiles:
        check_compilation(args, runtime)
        return list(args.compilation_config.compile_sizes)
    if not runtime.graphs_by_default or args.enforce_eager:
        return []
    return decode_buckets(min(args.max_num_seqs, MAX_GRAPH_BATCH))


def check_compilation(args: EngineArgs, runtime: DeviceRuntime) -> None:
    """Refuse, by what is wrong, a `compilation_config` that asks for compiled steps where
    they cannot run as asked."""
    mode, sizes = args.compilation_config.mode, args.compilation_config.compile_sizes
    too_large = [size for size in sizes if size > args.max_num_seqs]
    checks = [
        (
            runtime.supports_graphs and not runtime.graphs_by_default,
            f"compilation_config mode {mode} compiles CPU steps; on {runtime.name} decode steps are captured "
            "as CUDA graphs already (enforce_eager turns them off)",
        ),
        (args.tensor_parallel_size == 1, "compilation_config: compiled steps do not support tensor parallelism yet"),
        (not args.enforce_eager, "compilation_config mode 3 compiles steps, and enforce_eager asks for none"),
        (not too_large, f"compilation_config compile_sizes {too_large} exceed max_num_seqs ({args.max_num_seqs})"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def build_tensor_parallel(args: EngineArgs) -> tuple[RankParts, TensorParallelExecutor]:
    """Start the workers, then build rank 0 here while they build theirs."""
    executor = start_executor(args)
    try:
        rank_zero_args = rank_args(args, 0)
        backend = create_runtime(rank_zero_args.device).distributed_backend()
        parallel = join_group(executor.address, 0, backend)
        rank = executor.guarded(lambda: build_rank(rank_zero_args, parallel))
        executor.runner = rank.runner
        executor.wait_ready()
    except BaseException:
        executor.shutdown()
        raise
    return rank, executor


def start_executor(args: EngineArgs) -> TensorParallelExecutor:
    if args.distributed_executor_backend == "ray":
        from kestrel.distributed.ray import RayExecutor

        return RayExecutor(args, build_worker_runner)
    address = GroupAddress.on_this_host(args.tensor_parallel_size)
    return MultiprocessExecutor(start_workers(args, address), address)


def build_worker_runner(args: EngineArgs, rank: int, address: GroupAddress) -> ModelRunner:
    """A worker's side of `build_tensor_parallel`."""
    parallel = join_group(address, rank, create_runtime(args.device).distributed_backend())
    return build_rank(args, parallel).runner


def snapshot_stops(args: EngineArgs, rank: RankParts) -> dict[str, int]:
    """Where prefill chunks stop so the recurrent state there can be kept: only where it is."""
    keeps_snapshots = rank.recurrent is not None and rank.kv.prefix_cache is not None
    return {"snapshot_interval": args.state_snapshot_interval if keeps_snapshots else 0}


def attach_host_tier(args: EngineArgs, rank: RankParts) -> None:
    """A host-memory tier of `kv_offloading_size` GiB behind the KV pool's prefix cache; for a
    hybrid model, split between pages and recurrent state snapshots, one snapshot per
    `state_snapshot_interval` tokens of pages (where its prefixes can end)."""
    if rank.kv.prefix_cache is None:
        raise ValueError("kv_offloading_size keeps the prefix cache's evicted pages; prefix caching is off")
    kv, recurrent = rank.kv, rank.recurrent
    page_bytes = kv.spec.bytes_per_page()
    pages_per_snapshot = args.state_snapshot_interval // args.page_size
    snapshot_bytes = recurrent.spec.bytes_per_slot() if recurrent is not None else 0
    unit_bytes = page_bytes * pages_per_snapshot + snapshot_bytes if recurrent is not None else page_bytes
    units = int(args.kv_offloading_size * GIB) // unit_bytes
    if units < 1:
        raise ValueError(
            f"kv_offloading_size={args.kv_offloading_size} GiB holds no KV page of {page_bytes} bytes"
            + (f" with a recurrent state snapshot of {snapshot_bytes} bytes" if recurrent is not None else "")
        )
    pin = rank.runtime.device.type == "cuda"  # page-locked, so copies to and from the GPU run asynchronously
    num_pages = units * pages_per_snapshot if recurrent is not None else units
    tier = HostKVTier([(kv.page_shape(), kv.spec.dtype)], num_pages, pin_memory=pin)
    if recurrent is not None:
        tier.snapshots = HostKVTier(recurrent.unit_layout(), units, pin_memory=pin)
    kv.attach_host_tier(tier)
    logger.info(
        "host KV tier: %d pages%s, %.2f GiB",
        num_pages,
        f" and {units} recurrent state snapshots" if recurrent is not None else "",
        (num_pages * page_bytes + (units * snapshot_bytes if recurrent is not None else 0)) / GIB,
    )


def build_engine_parts(args: EngineArgs) -> EngineParts:
    if uses_mtp_head(args) and args.enable_prefix_caching:
        # A cached prefix gives the target no hidden states for its positions, and the head
        # cannot draft without its rows for them: its KV does not join the prefix cache yet.
        logger.warning("prefix caching is turned off: speculative decoding's 'mtp' method does not support it yet")
        args = dataclasses.replace(args, enable_prefix_caching=False)
    draft = None
    if args.tensor_parallel_size > 1:
        if wants_draft_model(args):
            raise ValueError("speculative decoding with a draft model runs with tensor_parallel_size 1 only so far")
        rank, executor = build_tensor_parallel(args)
    elif wants_draft_model(args):
        rank, draft = build_with_draft(args)
        executor = LocalExecutor(rank.runner)
    else:
        rank = build_rank(args, SINGLE)
        executor = LocalExecutor(rank.runner)
    if args.kv_offloading_size is not None:
        attach_host_tier(args, rank)
    tokenizer = load_tokenizer(args, rank.checkpoint)
    return EngineParts(
        args=args,
        runtime=rank.runtime,
        spec=rank.spec,
        dtype=rank.dtype,
        quantization=rank.quantization,
        kv=rank.kv,
        recurrent=rank.recurrent,
        groups=rank.runner.groups,
        runner=rank.runner,
        executor=executor,
        planner=FcfsPlanner(
            PlannerConfig(rank.max_num_batched_tokens, args.max_num_seqs, **snapshot_stops(args, rank))
        ),
        tokenizer=tokenizer,
        max_model_len=rank.max_model_len,
        max_num_batched_tokens=rank.max_num_batched_tokens,
        eos_token_ids=eos_token_ids(rank.spec, tokenizer, rank.checkpoint),
        draft=draft,
    )


# ---- speculative decoding's draft model ------------------------------------------------------


def wants_draft_model(args: EngineArgs) -> bool:
    """Whether speculation drafts with a second rank: a draft model, or the MTP head."""
    return args.speculative_config is not None and args.speculative_config.method in ("draft_model", "mtp")


def uses_mtp_head(args: EngineArgs) -> bool:
    return args.speculative_config is not None and args.speculative_config.method == "mtp"


def draft_model_args(args: EngineArgs) -> EngineArgs:
    """The draft's engine args: the target's, but its own checkpoint (the MTP head comes from
    the target's), no prefix cache (it catches up on a prompt by computing it), no recurrent
    state (a draft is attention-only) and a KV budget set once the target's is known."""
    own_checkpoint = not uses_mtp_head(args)
    return dataclasses.replace(
        args,
        model=args.speculative_config.model if own_checkpoint else args.model,
        tokenizer=None,
        revision=None if own_checkpoint else args.revision,
        load_format="dummy" if args.load_format == "dummy" else "auto",
        max_model_len=None,
        kv_cache_memory_gb=None,
        enable_prefix_caching=False,
        kv_offloading_size=None,
        speculative_config=None,
        preemption_mode="recompute",
        mamba_ssm_cache_dtype="auto",
    )


def build_with_draft(args: EngineArgs) -> tuple[RankParts, RankParts]:
    """The target and the draft model. Both load before the target sizes its pool (on a GPU
    its budget is what both models' weights leave); the pools split the budget so each holds
    the same number of tokens."""
    target = load_rank_model(args, SINGLE)
    draft_args = draft_model_args(args)
    draft = load_rank_model(draft_args, SINGLE, mtp_head=uses_mtp_head(args))
    if uses_mtp_head(args):
        draft.model.allocate_hidden_buffers(draft.max_num_batched_tokens)
    if draft.fixed_specs:
        raise ValueError(
            f"the draft model {draft_args.model} ({draft.spec.architecture}) keeps recurrent state; "
            "a draft model must be attention-only so far"
        )
    if draft.spec.vocab_size > target.spec.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.spec.vocab_size} tokens) is larger than the target's "
            f"({target.spec.vocab_size}): the two must share a tokenizer"
        )
    draft_per_token = draft.kv_bytes_per_token()
    share = target.kv_bytes_per_token() / (target.kv_bytes_per_token() + draft_per_token)
    target_rank = build_rank(args, SINGLE, target, kv_share=share)
    # One page past the target's capacity: the budget's rounding down then never costs a page.
    tokens = target_rank.kv.capacity_tokens + args.page_size
    draft_args = dataclasses.replace(draft_args, kv_cache_memory_gb=tokens * draft_per_token / GIB)
    target_rank.runner.keep_hidden_states = uses_mtp_head(args)
    return target_rank, build_rank(draft_args, SINGLE, draft)
