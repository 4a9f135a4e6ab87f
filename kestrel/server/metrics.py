"""Prometheus metrics with vLLM's names under the `kestrel:` prefix, one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kestrel.server.messages import CoreStats

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kestrel:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kestrel:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kestrel:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.running = gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.kv_used_pages = gauge("kv_cache_used_pages", "KV-cache pages held by requests.")
        self.prompt_tokens = Counter(
            "kestrel:prompt_tokens", "Prefill tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "kestrel:generation_tokens", "Generation tokens processed.", labels, registry=self.registry
        )
        self.request_success = Counter(
            "kestrel:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.prefix_queries = Counter(
            "kestrel:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=self.registry,
        )
        self.prefix_hits = Counter(
            "kestrel:prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache.",
            labels,
            registry=self.registry,
        )
        self._seen_queries = self._seen_hits = 0
        self._totals = {  # CoreStats' running totals, as counters
            "num_preemptions": counter("num_preemptions", "Requests preempted because the KV cache was full."),
            "structured_requests": counter("structured_output_requests", "Requests with an output constraint."),
            "grammars_compiled": counter("grammar_compilations", "Grammars compiled (cache misses)."),
            "grammar_compile_seconds": counter("grammar_compile_seconds", "Time compiling grammars."),
            "grammar_mask_seconds": counter("grammar_mask_seconds", "Host time filling grammar token masks."),
            "kv_offload_hit_tokens": counter("kv_offload_hits", "Prompt tokens whose KV came back from host memory."),
            "kv_offload_stored_bytes": counter("kv_offload_stored_bytes", "KV bytes copied to the host tier."),
            "kv_offload_loaded_bytes": counter("kv_offload_loaded_bytes", "KV bytes copied back from the host tier."),
            "spec_decode_num_drafts": counter("spec_decode_num_drafts", "Speculative verify chunks run."),
            "spec_decode_num_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens checked."),
            "spec_decode_num_accepted_tokens": counter(
                "spec_decode_num_accepted_tokens", "Draft tokens that matched the target model's samples."
            ),
        }
        self._seen_totals = dict.fromkeys(self._totals, 0.0)
        # Prefill/decode handoff (server/disaggregation.py).
        self.kv_transfer_pending = gauge("kv_transfer_pending", "Prefilled states held for a decode instance.")
        self.kv_transfer_pending_bytes = gauge("kv_transfer_pending_bytes", "Bytes of the prefilled states held.")
        self.kv_transfer_lent = gauge(
            "kv_transfer_lent", "Prefilled states fetched through CUDA IPC, held on the GPU until copied."
        )
        self.kv_lent_bytes = gauge(
            "kv_transfer_device_bytes", "Bytes of prefilled state the engine keeps on its GPU for decode instances."
        )
        self.kv_transfer_sent_bytes = counter("kv_transfer_sent_bytes", "Prefilled state bytes fetched from here.")
        self.kv_transfer_expired = counter("kv_transfer_expired", "Prefilled states dropped unfetched.")
        self.kv_transfer_received_bytes = counter("kv_transfer_received_bytes", "Prefilled state bytes fetched.")
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "Time to fetch a prefilled state.")
        # Plain running totals beside the counters, for the periodic stats line.
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.inter_token = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = histogram("request_queue_time_seconds", "Time spent waiting before first scheduling.")

    def observe_stats(self, stats: CoreStats) -> None:
        label = self.model_name
        self.running.labels(label).set(stats.num_running)
        self.waiting.labels(label).set(stats.num_waiting)
        self.kv_usage.labels(label).set(stats.kv_cache_usage)
        self.kv_used_pages.labels(label).set(stats.num_used_pages)
        self.kv_lent_bytes.labels(label).set(stats.kv_lent_bytes)
        # The core reports running totals; counters advance by what is new since last time.
        self.prefix_queries.labels(label).inc(max(stats.prefix_cache_queries - self._seen_queries, 0))
        self.prefix_hits.labels(label).inc(max(stats.prefix_cache_hits - self._seen_hits, 0))
        self._seen_queries, self._seen_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        for name, counter in self._totals.items():
            total = getattr(stats, name)
            counter.labels(label).inc(max(total - self._seen_totals[name], 0))
            self._seen_totals[name] = total

    def render(self, stats: CoreStats) -> bytes:
        self.observe_stats(stats)
        return generate_latest(self.registry)


class RequestTimer:
    """Latency facts for one request, reported to the metrics as tokens arrive."""

    def __init__(self, metrics: ServerMetrics, start: float, num_prompt_tokens: int) -> None:
        self.metrics, self.start, self.last = metrics, start, None
        self.label = metrics.model_name
        metrics.prompt_tokens.labels(self.label).inc(num_prompt_tokens)
        metrics.num_prompt_tokens += num_prompt_tokens

    def tokens(self, now: float, count: int, queue_seconds: float | None) -> None:
        if queue_seconds is not None:
            self.metrics.queue_time.labels(self.label).observe(queue_seconds)
        if count == 0:
            return
        self.metrics.generation_tokens.labels(self.label).inc(count)
        self.metrics.num_generation_tokens += count
        if self.last is None:
            self.metrics.ttft.labels(self.label).observe(now - self.start)
        else:
            self.metrics.inter_token.labels(self.label).observe((now - self.last) / count)
        self.last = now

    def finished(self, now: float, reason: str) -> None:
        self.metrics.e2e.labels(self.label).observe(now - self.start)
        self.metrics.request_success.labels(self.label, reason).inc()
