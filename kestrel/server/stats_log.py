"""The server's periodic engine stats line, as vLLM logs one: requests running and waiting,
KV-cache usage, and prompt and generation throughput since the last line."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from kestrel.server.engine_client import EngineClient
from kestrel.server.metrics import ServerMetrics

logger = logging.getLogger("kestrel.server")


def stats_interval() -> float:
    """Seconds between lines: 10, or `KESTREL_LOG_STATS_INTERVAL` (vLLM's VLLM_LOG_STATS_INTERVAL)."""
    return float(os.environ.get("KESTREL_LOG_STATS_INTERVAL", "10"))


async def log_engine_stats(client: EngineClient, metrics: ServerMetrics) -> None:
    """A line every interval in which anything ran or waited; runs until cancelled."""
    interval = stats_interval()
    last_time = time.monotonic()
    last_prompt, last_generation = metrics.num_prompt_tokens, metrics.num_generation_tokens
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        prompt = metrics.num_prompt_tokens - last_prompt
        generation = metrics.num_generation_tokens - last_generation
        stats = client.stats
        if prompt or generation or stats.num_running or stats.num_waiting:
            logger.info(
                "engine: %d running, %d waiting, KV cache %.1f%% used, prompt %.1f tokens/s, generation %.1f tokens/s",
                stats.num_running,
                stats.num_waiting,
                100 * stats.kv_cache_usage,
                prompt / (now - last_time),
                generation / (now - last_time),
            )
        last_time, last_prompt, last_generation = now, metrics.num_prompt_tokens, metrics.num_generation_tokens
