"""Prometheus metrics for the server, on a registry of its own (several servers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Request counts by endpoint and status, token counts, engine load, restarts, non-finite failures, TTFT and
    inter-token latency."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("k3v_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("k3v_prompt_tokens", "Prompt tokens of requests accepted by the engine",
                                     registry=self.registry)
        self.generation_tokens = Counter("k3v_generation_tokens", "Generated tokens delivered to clients",
                                         registry=self.registry)
        self.queue_depth = Gauge("k3v_queue_depth", "Requests waiting for admission", registry=self.registry)
        self.running = Gauge("k3v_running_batch_size", "Sequences in the running batch", registry=self.registry)
        self.ttft = Histogram("k3v_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.restarts = Counter("k3v_engine_restarts", "Engine loop restarts by the supervisor (fresh caches)",
                                registry=self.registry)
        self.nonfinite = Counter("k3v_nonfinite_logits", "Requests failed because the model produced NaN/inf logits",
                                 registry=self.registry)
        self.inter_token = Histogram("k3v_inter_token_latency_seconds", "Time between consecutive generated tokens",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def set_load(self, num_waiting: int, num_running: int) -> None:
        self.queue_depth.set(num_waiting)
        self.running.set(num_running)

    def count_restart(self) -> None:
        self.restarts.inc()

    def count_nonfinite(self) -> None:
        self.nonfinite.inc()

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
