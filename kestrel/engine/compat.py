"""vLLM's engine arguments that Kestrel has under another name, or that mean nothing here.

A copied `LLM(...)` call or `vllm serve` line should work or say what it cannot do: one table
serves both. Arguments Kestrel does not know at all still raise TypeError (a typo must not
pass quietly).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("kestrel")

# vLLM's name -> Kestrel's.
RENAMED = {"block_size": "page_size", "tokenizer_revision": "revision"}

# Accepted with a warning: each value is why the argument changes nothing in Kestrel.
WITHOUT_EFFECT = {
    "trust_remote_code": "Kestrel runs no code from checkpoints; its own recipes implement each architecture",
    "swap_space": "preemption_mode='swap' holds preempted requests' state in host memory as needed",
    "disable_custom_all_reduce": "tensor parallelism uses the NCCL or gloo all-reduce only",
    "max_seq_len_to_capture": "CUDA graphs cover decode steps of every length",
    "disable_log_stats": "the offline engine logs no periodic stats",
    "enable_chunked_prefill": "chunked prefill is always on",
    "tokenizer_mode": "the tokenizer is transformers' fast tokenizer",
    "worker_cls": "workers are Kestrel's own",
    "enable_sleep_mode": "there is no sleep mode",
    "disable_async_output_proc": "outputs are always processed while the next step runs",
    "use_v2_block_manager": "Kestrel has one paged KV allocator",
    "served_model_name": "the offline engine answers no requests by model name",
}

# Accepted only at their default: anything else asks for what Kestrel does not do yet.
DEFAULT_ONLY = {
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "cpu_offload_gb": 0,
    "hf_overrides": None,
    "kv_transfer_config": None,
    "enable_lora": False,
    "num_scheduler_steps": 1,
    "scheduling_policy": "fcfs",
    "download_dir": None,
    "limit_mm_per_prompt": None,
    "mm_processor_kwargs": None,
    "max_logprobs": 20,
}


def resolve_vllm_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """Kestrel's engine arguments for `arguments`, which may use vLLM's names."""
    resolved = {}
    for name, value in arguments.items():
        if name in RENAMED:
            resolved[RENAMED[name]] = value
        elif name in WITHOUT_EFFECT:
            logger.warning("%s=%r has no effect: %s", name, value, WITHOUT_EFFECT[name])
        elif name in DEFAULT_ONLY:
            if value != DEFAULT_ONLY[name]:
                raise ValueError(f"{name}={value!r} is not supported yet (only {DEFAULT_ONLY[name]!r})")
        else:
            resolved[name] = value
    return resolved
