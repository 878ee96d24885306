"""Prometheus metrics, on registries of their own (several servers can share a process).

EngineMetrics is what the engine observes (load, TTFT, inter-token latency, restarts, non-finite failures, and with
`serve --speculative` the speculator's drafted / accepted tokens, score passes, auto-off and cost-policy declines, and
the prefix cache's hits, misses, reused tokens, snapshots and evictions), kept
where the engine runs; ServerMetrics is what the HTTP side counts (requests, tokens), and renders both: the
engine's from its own EngineMetrics in one process, or as text fetched from the engine's process when the HTTP
server runs in a process of its own (api/engine_link.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from k3verify.serving.prefix_reuse import PrefixReuse
    from k3verify.serving.spec.step import SpecCounters

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# counter name (exposed with _total) -> (SpecCounters field, help)
SPECULATION_COUNTERS = {
    "k3v_spec_verify_steps": ("score_steps", "Speculative score passes run"),
    "k3v_spec_drafted_tokens": ("drafted", "Draft tokens scored (those a request could still use)"),
    "k3v_spec_accepted_tokens": ("accepted", "Draft tokens the score passes accepted"),
    "k3v_spec_emitted_tokens": ("emitted", "Tokens emitted by score passes (accepted drafts and the bonus token)"),
    "k3v_spec_verified_rows": ("scored_rows", "Rows with drafts in score passes"),
    "k3v_spec_rider_rows": ("rider_rows", "Greedy rows without drafts that rode along in a score pass"),
    "k3v_spec_requests_turned_off": ("turned_off", "Requests whose speculation the per-request auto-off stopped"),
    "k3v_spec_gate_declined_steps": ("declined_steps", "Steps with drafts that the cost policy sent to plain decode"),
    "k3v_spec_plain_ahead_steps": ("plain_ahead_steps",
                                   "Steps decoded plainly with launch-ahead while the cost policy declined"),
}


class _SpeculationCollector:
    """The speculator's totals as Prometheus counters, read when scraped; none while nothing speculates."""

    def __init__(self) -> None:
        self.counters: SpecCounters | None = None

    def collect(self) -> Iterator[Metric]:
        if self.counters is None:
            return
        for name, (field, doc) in SPECULATION_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(self.counters, field))


class _PrefixCacheCollector:
    """The prefix cache's totals (hits, misses by reason, prompt tokens reused, evictions) and holdings (snapshots,
    their bytes, the budget), read from the engine's cache when scraped; none while the cache is off."""

    def __init__(self) -> None:
        self.source: Callable[[], PrefixReuse | None] | None = None

    def collect(self) -> Iterator[Metric]:
        reuse = self.source() if self.source is not None else None
        if reuse is None:
            return
        cache, c = reuse.cache, reuse.cache.counters
        yield CounterMetricFamily("k3v_prefix_cache_hits", "Requests that resumed from a cached prefix", value=c.hits)
        misses = CounterMetricFamily("k3v_prefix_cache_misses", "Requests that found no cached prefix, by reason",
                                     labels=["reason"])
        for reason, n in sorted(dict(c.misses).items()):
            misses.add_metric([reason], n)
        yield misses
        yield CounterMetricFamily("k3v_prefix_cache_tokens_reused", "Prompt tokens served from the prefix cache",
                                  value=c.tokens_reused)
        yield CounterMetricFamily("k3v_prefix_cache_evictions", "Prefix-cache entries evicted (budget or pages)",
                                  value=c.evictions)
        yield GaugeMetricFamily("k3v_prefix_cache_snapshots", "KDA state snapshots held", value=cache.num_snapshots)
        yield GaugeMetricFamily("k3v_prefix_cache_snapshot_bytes", "Bytes of the KDA state snapshots held",
                                value=cache.snapshot_bytes)
        yield GaugeMetricFamily("k3v_prefix_cache_budget_bytes", "The snapshot budget in bytes",
                                value=cache.budget_bytes)


class EngineMetrics:
    """Engine load, restarts, non-finite failures, TTFT and inter-token latency (the engine's Observer)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.speculation = _SpeculationCollector()
        self.registry.register(self.speculation)
        self.prefix_cache = _PrefixCacheCollector()
        self.registry.register(self.prefix_cache)

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

    def watch_speculation(self, counters: SpecCounters) -> None:
        self.speculation.counters = counters

    def watch_prefix_cache(self, source: Callable[[], PrefixReuse | None]) -> None:
        """Where the engine's prefix cache is (the runner rebuilds it with its caches), read at every scrape."""
        self.prefix_cache.source = source

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics:
    """Request counts by endpoint and status and token counts; with the engine's metrics when they live here (an
    in-process engine observes `self.engine`, through the Observer methods below) or `engine_text`, the engine's
    exposition fetched from wherever it runs."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_text: Callable[[], bytes] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("k3v_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("k3v_prompt_tokens", "Prompt tokens of requests accepted by the engine",
                                     registry=self.registry)
        self.generation_tokens = Counter("k3v_generation_tokens", "Generated tokens delivered to clients",
                                         registry=self.registry)
        self.engine: EngineMetrics | None = EngineMetrics() if engine_text is None else None
        self.engine_text = engine_text if engine_text is not None else self._local_engine_text

    def _local_engine_text(self) -> bytes:
        assert self.engine is not None
        return self.engine.render()

    def _observer(self) -> EngineMetrics:
        if self.engine is None:
            raise RuntimeError("these ServerMetrics render a remote engine's metrics; observe on its EngineMetrics")
        return self.engine

    def observe_ttft(self, seconds: float) -> None:
        self._observer().observe_ttft(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._observer().observe_inter_token(seconds)

    def set_load(self, num_waiting: int, num_running: int) -> None:
        self._observer().set_load(num_waiting, num_running)

    def count_restart(self) -> None:
        self._observer().count_restart()

    def count_nonfinite(self) -> None:
        self._observer().count_nonfinite()

    def watch_speculation(self, counters: SpecCounters) -> None:
        self._observer().watch_speculation(counters)

    def watch_prefix_cache(self, source: Callable[[], PrefixReuse | None]) -> None:
        self._observer().watch_prefix_cache(source)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + self.engine_text()
