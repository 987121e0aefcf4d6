"""LoRA metrics for routers (KServe, llm-d, the Gateway API inference extension): which adapters this
server holds, how often it loads them, and vLLM's `lora_requests_info`.

Each metric is exported twice, under `loraserve:` and `vllm:` (routers look for vLLM's names):
- `lora_adapter_loaded{lora_name, level}` = 1 for each adapter in a compute slot (`level="slot"`) and
  for each adapter in host memory (`level="host"`). An adapter in a slot is always in host memory
  too, so it has both series; an adapter with neither is not resident (reading it costs a load).
- `lora_loads_total{outcome}`: adapter loads from storage into host memory, `outcome="success"`
  (first loads and reloads after eviction) or `"failure"`.
- `loraserve:lora_cache_events_total{event, policy}` (loraserve's name only: vLLM has none):
  `event="host_eviction"`, `"prefetch"` (an evicted adapter read back beside the step for a queued
  request) or `"prefetch_failure"`, `policy` the host cache's eviction policy ("lru" or "cost").
- `lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}` = the scrape time
  (Unix seconds), vLLM's labels and value: the adapters of the running and waiting requests, each
  comma-separated (sorted here), and the number of compute slots. One series, the current one.
Exported only when the engine serves LoRA (its stats carry `max_lora`). Behind `--replicas` the
ingress exports these for every replica, each sample labelled `replica=<id>`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIXES = ("loraserve:", "vllm:")
# Engine stats keys only these families read; the generic engine-stats export leaves them out.
OWN_KEYS = ("max_lora", "lora_adapters_loaded")
LEVELS = ("slot", "host")
_INFO_LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]


def _adapter_names(counts: Any) -> str:
    """Comma-separated names of the adapters with requests ("" is the base model: not an adapter)."""
    if not isinstance(counts, Mapping):
        return ""
    return ",".join(sorted(str(name) for name, count in counts.items() if name and count))


_CACHE_EVENTS = (
    ("host_eviction", "lora_num_host_evictions"),
    ("prefetch", "lora_num_prefetches"),
    ("prefetch_failure", "lora_num_prefetch_failures"),
)


def _cache_events(prefix: str, stats: Mapping[str, Any], names: list[str], values: list[str]) -> Metric:
    events = CounterMetricFamily(
        prefix + "lora_cache_events",
        "Host-cache evictions and prefetches of adapters, by the host cache's eviction policy.",
        labels=["event", "policy", *names],
    )
    policy = str(stats.get("lora_eviction_policy", "lru"))
    for event, key in _CACHE_EVENTS:
        events.add_metric([event, policy, *values], float(stats.get(key, 0)))
    return events


def lora_families(stats: Mapping[str, Any], now: float, extra: Mapping[str, str]) -> Iterator[Metric]:
    """The LoRA metrics of one engine's stats (see the module doc), each sample also labelled `extra`;
    `now` is the value of `lora_requests_info`. Nothing when the engine does not serve LoRA."""
    max_lora = stats.get("max_lora")
    if not isinstance(max_lora, int):
        return
    names, values = list(extra), list(extra.values())
    loaded = stats.get("lora_adapters_loaded")
    loaded = loaded if isinstance(loaded, Mapping) else {}
    info_values = [
        str(max_lora),
        _adapter_names(stats.get("waiting_by_adapter")),
        _adapter_names(stats.get("running_by_adapter")),
    ]
    for prefix in PREFIXES:
        residency = GaugeMetricFamily(
            prefix + "lora_adapter_loaded",
            "1 for each adapter resident at a level: a compute slot (slot) or host memory (host); "
            "an adapter in a slot is in host memory too.",
            labels=["lora_name", "level", *names],
        )
        for level in LEVELS:
            for name in loaded.get(level, ()):
                residency.add_metric([str(name), level, *values], 1.0)
        yield residency
        loads = CounterMetricFamily(
            prefix + "lora_loads",
            "Adapter loads from storage into host memory, first loads and reloads after eviction.",
            labels=["outcome", *names],
        )
        loads.add_metric(["success", *values], float(stats.get("lora_num_loads", 0)))
        loads.add_metric(["failure", *values], float(stats.get("lora_num_load_failures", 0)))
        yield loads
        if prefix == PREFIXES[0]:
            yield _cache_events(prefix, stats, names, values)
        info = GaugeMetricFamily(
            prefix + "lora_requests_info", "Running stats on lora requests.", labels=[*_INFO_LABELS, *names]
        )
        info.add_metric([*info_values, *values], now)
        yield info
