"""Prometheus metrics of one server: request and token counters, latency histograms, engine gauges.

Each server owns its own CollectorRegistry, so several servers (tests) can live in one process. The
engine's `stats()` is read once per scrape: numbers become gauges (counters for the monotonic keys in
`_COUNTERS`, exported with Prometheus' `_total` suffix), `{adapter: count}` maps become gauges
labelled `lora_name` ("" is the base model), and lists are new observations (seconds, e.g. adapter load
latencies drained since the previous call) added to a histogram of the same name. The LoRA residency
and request-info metrics routers read are `lora_metrics.py`'s.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.entrypoints.openai.lora_metrics import LoRAMetricsCollector

logger = logging.getLogger(__name__)

PREFIX = "loraserve:"
# Engine stats keys with a fixed public name; any other key is exported as PREFIX + key.
_RENAMED = {
    "num_running": "num_requests_running",
    "num_waiting": "num_requests_waiting",
    "running_by_adapter": "num_requests_running_by_lora",
    "waiting_by_adapter": "num_requests_waiting_by_lora",
}
# Engine stats keys that only ever grow: exported as counters, so rate() and alerts work on them.
_COUNTERS = {"num_step_failures": "Engine steps that raised; their requests failed, the engine went on."}
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _metric_name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", _RENAMED.get(key, key))


class _SnapshotCollector(Collector):
    """The numeric and per-adapter entries of the latest engine stats snapshot, as gauges (counters)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        for key, value in sorted(self.snapshot.items()):
            name = _metric_name(key)
            if key in _COUNTERS and isinstance(value, (int, float)):
                yield CounterMetricFamily(name, _COUNTERS[key], value=float(value))
            elif isinstance(value, (bool, int, float)):
                yield GaugeMetricFamily(name, f"Engine stat {key}.", value=float(value))
            elif isinstance(value, dict):
                family = GaugeMetricFamily(name, f"Engine stat {key}, per adapter.", labels=["lora_name"])
                for label, count in sorted(value.items(), key=lambda kv: str(kv[0])):
                    if isinstance(count, (int, float)):
                        family.add_metric([str(label or "")], float(count))
                yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ServerMetrics:
    """Counters and histograms the serving layer records, plus the engine's stats at scrape time."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]] | None = None) -> None:
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
        self._engine_gauges = _SnapshotCollector()
        self._engine_histograms: dict[str, Histogram] = {}
        self.registry.register(self._engine_gauges)
        self._lora = LoRAMetricsCollector()
        self.registry.register(self._lora)

    def refresh(self) -> None:
        """Read the engine's stats once; list entries are new observations for their histograms."""
        if self.get_stats is None:
            return
        try:
            stats = dict(self.get_stats())
        except Exception:
            logger.exception("Engine stats could not be read for /metrics.")
            return
        stats = self._lora.update(stats)
        gauges = {}
        for key, value in stats.items():
            if isinstance(value, (list, tuple)):
                histogram = self._engine_histograms.get(key)
                if histogram is None:
                    histogram = Histogram(
                        _metric_name(key),
                        f"Engine observations of {key}.",
                        buckets=_LOAD_BUCKETS,
                        registry=self.registry,
                    )
                    self._engine_histograms[key] = histogram
                for seconds in value:
                    histogram.observe(float(seconds))
            else:
                gauges[key] = value
        self._engine_gauges.snapshot = gauges

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)
