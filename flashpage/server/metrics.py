"""Prometheus metrics of the server (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("flashpage_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("flashpage_inter_token_latency_seconds", "Time between tokens of a sample", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("flashpage_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("flashpage_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("flashpage_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("flashpage_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.running = Gauge("flashpage_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("flashpage_num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("flashpage_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.prefix_hit_rate = Gauge("flashpage_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens)",
                                     registry=r)
        self.preemptions = Gauge("flashpage_num_preemptions", "Preemptions since start", registry=r)

    def update_engine(self, stats: dict) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(1 - stats["kv_blocks_free"] / stats["kv_blocks_total"])
        q = stats["prefix_cache_queries"]
        self.prefix_hit_rate.set(stats["prefix_cache_hits"] / q if q else 0.0)
        self.preemptions.set(stats["num_preemptions"])
