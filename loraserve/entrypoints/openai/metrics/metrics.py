"""Prometheus metrics of one server: request and token counters, latency histograms, engine gauges.

vLLM's names and label sets are exported beside loraserve's (`vllm_metrics.py`).

Each server owns its own CollectorRegistry, so several servers (tests) can live in one process. The
engine's `stats()` is read once per scrape and exported by `engine_metrics.stats_families` (gauges,
counters, per-adapter gauges, the LoRA metrics routers read); its lists are new observations (seconds,
e.g. adapter load latencies drained since the previous call) added to a histogram of the same name.

Behind `--replicas` the HTTP server is an ingress with no engine: each scrape also asks every replica
for its engine's stats (`get_replica_stats`, bounded in time by the caller) and exports them the same
way, each sample labelled `replica=<id>`; a replica that did not answer is left out of that scrape and
counted in `loraserve:replica_scrape_failures_total{replica}`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from loraserve.entrypoints.openai.metrics.engine_metrics import (
    PREFIX,
    merge_families,
    metric_name,
    stats_families,
)
from loraserve.entrypoints.openai.metrics.vllm_metrics import (
    ENGINE,
    VllmRequestMetrics,
    vllm_engine_families,
)

logger = logging.getLogger(__name__)

REPLICA_LABEL = "replica"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Replica id -> its engine's stats, or None for a replica that did not answer in time.
ReplicaStats = Mapping[str, Mapping[str, Any] | None]
Snapshot = tuple[dict[str, str], dict[str, Any]]  # (extra labels, one engine's stats without lists)


class _EngineStatsCollector(Collector):
    """The families of the latest engine stats snapshots (one per engine), merged by name."""

    def __init__(self, clock: Callable[[], float] = time.time, model_name: str = "") -> None:
        self._clock = clock
        self.model_name = model_name
        self.snapshots: list[Snapshot] = []

    def collect(self) -> Iterator[Metric]:
        now = float(self._clock())
        families = [f for extra, stats in self.snapshots for f in stats_families(stats, now, extra)]
        for extra, stats in self.snapshots:  # vLLM's names: engine "0", or the replica's id
            families.extend(vllm_engine_families(stats, self.model_name, extra.get(REPLICA_LABEL, ENGINE)))
        return iter(merge_families(families))

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ServerMetrics:
    """Counters and histograms the serving layer records, plus the engine's stats at scrape time."""

    def __init__(
        self,
        get_stats: Callable[[], dict[str, Any]] | None = None,
        get_replica_stats: Callable[[], Awaitable[ReplicaStats]] | None = None,
        model_name: str = "",  # vLLM's `model_name` label: the first served name
    ) -> None:
        self.get_stats = get_stats
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.requests = Counter(
            PREFIX + "requests",
            "Finished generation requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive token-producing outputs of one request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lora_add_seconds = Histogram(
            PREFIX + "lora_add_seconds",
            "Time to validate and register an adapter (load route, resolvers, --lora-modules).",
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        # Per API key: the key's configured label (--api-key-file), never the key itself.
        self.key_requests = Counter(
            PREFIX + "api_key_requests",
            "Requests that carried an API key, by the key's label ('key-<i>' for the i-th --api-key).",
            ["api_key"],
            registry=self.registry,
        )
        self.vllm = VllmRequestMetrics(self.registry, model_name)
        self._engine_stats = _EngineStatsCollector(model_name=model_name)
        self.registry.register(self._engine_stats)
        self._local: dict[str, Any] = {}  # the last stats get_stats returned, lists left out
        # Histograms of the engines' list entries: stats key -> (histogram, its label names).
        self._engine_histograms: dict[str, tuple[Histogram, tuple[str, ...]]] = {}
        self.get_replica_stats = get_replica_stats
        self._seen_replicas: set[str] = set()  # the replicas of the previous scrape
        self.replica_scrape_failures = Counter(
            PREFIX + "replica_scrape_failures",
            "Scrapes that got no engine stats from a replica (late, lost or failing; left out of that scrape).",
            [REPLICA_LABEL],
            registry=self.registry if get_replica_stats is not None else None,
        )

    def refresh(self, replica_stats: ReplicaStats | None = None) -> None:
        """Read the engine's stats once (and take the replicas' as fetched); list entries are new
        observations for their histograms."""
        if self.get_stats is not None:
            try:
                self._local = self._split(dict(self.get_stats()), {})
            except Exception:
                logger.exception("Engine stats could not be read for /metrics.")
        snapshots: list[Snapshot] = [({}, self._local)] if self._local else []
        for replica_id, stats in sorted((replica_stats or {}).items()):
            if stats is None:
                self.replica_scrape_failures.labels(replica_id).inc()
                continue
            extra = {REPLICA_LABEL: replica_id}
            snapshots.append((extra, self._split(dict(stats), extra)))
        self._engine_stats.snapshots = snapshots
        if replica_stats is not None:
            self._forget_replicas(set(self._seen_replicas) - set(replica_stats))
            self._seen_replicas = set(replica_stats)

    def _forget_replicas(self, replica_ids: set[str]) -> None:
        """Series of replicas the ingress no longer routes to (Ray replaced them) leave the exposition."""
        labelled = [h for h, names in self._engine_histograms.values() if names == (REPLICA_LABEL,)]
        for metric in [*labelled, self.replica_scrape_failures]:
            for replica_id in replica_ids:
                with contextlib.suppress(KeyError):  # no series of that replica in this one
                    metric.remove(replica_id)

    def _split(self, stats: dict[str, Any], extra: dict[str, str]) -> dict[str, Any]:
        """`stats` without its lists, whose entries go to their histograms (labelled `extra`)."""
        rest = {}
        for key, value in stats.items():
            if not isinstance(value, (list, tuple)):
                rest[key] = value
                continue
            label_names = tuple(extra)
            histogram, known_names = self._engine_histograms.get(key) or (None, label_names)
            if histogram is None:
                histogram = Histogram(
                    metric_name(key),
                    f"Engine observations of {key}.",
                    label_names,
                    buckets=_LOAD_BUCKETS,
                    registry=self.registry,
                )
                self._engine_histograms[key] = (histogram, label_names)
            if known_names != label_names:  # one histogram has one label set; never mixed in practice
                continue
            series = histogram.labels(*extra.values()) if extra else histogram
            for seconds in value:
                series.observe(float(seconds))
        return rest

    def render(self) -> bytes:
        """The exposition text with the engine's stats read now (no replicas: see `render_async`)."""
        self.refresh()
        return generate_latest(self.registry)

    async def render_async(self) -> bytes:
        """`render`, with the replicas' stats fetched first when this server is a replicas' ingress."""
        replica_stats = await self.get_replica_stats() if self.get_replica_stats is not None else None
        self.refresh(replica_stats)
        return generate_latest(self.registry)
