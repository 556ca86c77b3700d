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
        self.prompt_tokens = Counter("flashpage_prompt_tokens", "Prompt tokens of requests that produced a token",
                                     registry=r)
        self.generation_tokens = Counter("flashpage_generation_tokens", "Generated tokens sent (aborted requests' too)",
                                         registry=r)
        self.requests = Counter("flashpage_requests", "Samples ended, by finish reason (abort: the client left, or "
                                "the server shut down)", ["finish_reason"], registry=r)
        self.running = Gauge("flashpage_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("flashpage_num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("flashpage_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.kv_capacity = Gauge("flashpage_kv_cache_capacity_tokens", "Tokens the KV cache holds (blocks x block "
                                 "size; a quantized cache holds about twice a 16-bit one's)", registry=r)
        self.prefix_hit_rate = Gauge("flashpage_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens)",
                                     registry=r)
        self.preemptions = Gauge("flashpage_num_preemptions", "Preemptions since start", registry=r)
        # vLLM's names, for the quantities flashpage has
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling", registry=r,
                                    buckets=_LATENCY_BUCKETS)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First scheduling to first token",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First token to last token", registry=r,
                                     buckets=_LATENCY_BUCKETS)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step",
                                          registry=r, buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                               8192, 16384))
        # speculative decoding (present only when the engine speculates)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Proposals verified", registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed", registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in the proposal", ["position"],
                                             registry=r)
        self._counted = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "spec_num_drafts": 0,
                         "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0}
        self._counted_per_pos: list[int] = []

    def update_engine(self, stats: dict) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(1 - stats["kv_blocks_free"] / stats["kv_blocks_total"])
        self.kv_capacity.set(stats["kv_cache_capacity_tokens"])
        q = stats["prefix_cache_queries"]
        self.prefix_hit_rate.set(stats["prefix_cache_hits"] / q if q else 0.0)
        self.preemptions.set(stats["num_preemptions"])
        for key, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                             ("spec_num_drafts", self.spec_drafts), ("spec_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_num_accepted_tokens", self.spec_accepted)):
            if key in stats:
                counter.inc(stats[key] - self._counted[key])
                self._counted[key] = stats[key]
        per_pos = stats.get("spec_accepted_per_position", [])
        self._counted_per_pos += [0] * (len(per_pos) - len(self._counted_per_pos))
        for i, n in enumerate(per_pos):
            self.spec_accepted_per_pos.labels(str(i)).inc(n - self._counted_per_pos[i])
            self._counted_per_pos[i] = n

    def request_finished(self, metrics) -> None:
        """A request's phases from its RequestMetrics."""
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.time_in_queue)
            if metrics.first_token_time is not None:
                self.prefill_time.observe(metrics.first_token_time - metrics.first_scheduled_time)
                self.decode_time.observe(metrics.last_token_time - metrics.first_token_time)
