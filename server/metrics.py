"""Prometheus metrics of one server (its own registry: two servers in one process never share counters)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("quantserve_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("quantserve_inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.duration = Histogram("quantserve_request_duration_seconds", "Arrival to the end of a request.",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("quantserve_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("quantserve_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.requests = Counter("quantserve_requests", "Requests by transport and outcome (length, stop, "
                                "cancelled, error, invalid, overloaded, unavailable, deadline, unauthenticated, "
                                "internal).", ["transport", "outcome"], registry=r)
        totals = engine.totals
        for name, help, field in (  # gauges read from the engine's totals when scraped
            ("quantserve_queue_depth", "Accepted requests waiting for KV blocks or a batch slot.", "queued"),
            ("quantserve_running_requests", "Requests in the running batch.", "running"),
            ("quantserve_kv_pool_capacity_bytes", "The preallocated KV pool.", "kv_capacity_bytes"),
            ("quantserve_kv_pool_used_bytes", "KV blocks reserved by running requests.", "kv_used_bytes"),
            ("quantserve_weight_bytes", "Weights as held in memory.", "weight_bytes"),
            ("quantserve_kv_cached_bytes", "Prefix-cache KV blocks no running request holds (evicted when needed).",
             "kv_cached_bytes"),
            ("quantserve_prefix_cache_hit_rate",
             "Prompt tokens mapped from the prefix cache / prompt tokens admitted.", "prefix_hit_rate"),
            ("quantserve_prefix_cache_hit_tokens", "Prompt tokens mapped from the prefix cache (a counter).",
             "prefix_hit_tokens"),
            ("quantserve_prefix_cache_evictions", "Cached KV blocks evicted for other requests' blocks (a counter).",
             "prefix_evictions"),
            ("quantserve_preemptions", "Requests' samples preempted for KV blocks, their blocks released and taken "
             "back later by recomputing (a counter).", "preemptions"),
            ("quantserve_recomputed_tokens", "Positions whose K/V was computed again after preemptions (a counter).",
             "recomputed_tokens"),
            ("quantserve_speculated_tokens", "Tokens drafted and verified by speculative decoding (a counter).",
             "speculated_tokens"),
            ("quantserve_accepted_tokens", "Drafted tokens the verification kept (a counter).", "accepted_tokens"),
            ("quantserve_speculation_acceptance_rate", "Accepted tokens / drafted tokens since the engine started.",
             "acceptance_rate"),
        ):
            Gauge(name, help, registry=r).set_function(lambda field=field: getattr(totals(), field))
        Gauge("quantserve_kv_cache", "How the KV cache is held (labels: its dtype, and how requests take blocks); "
              "the value is 1.", ["dtype", "admission"], registry=r).labels(
            engine.layout.kv_dtype, engine.config.kv_admission).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
