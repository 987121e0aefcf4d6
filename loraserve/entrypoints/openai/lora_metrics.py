"""LoRA metrics for routers (KServe, llm-d, the Gateway API inference extension): which adapters this
server holds, how often it loads them, and vLLM's `lora_requests_info`.

Each metric is exported twice, under `loraserve:` and `vllm:` (routers look for vLLM's names):
- `lora_adapter_loaded{lora_name, level}` = 1 for each adapter in a compute slot (`level="slot"`) and
  for each adapter in host memory (`level="host"`). An adapter in a slot is always in host memory
  too, so it has both series; an adapter with neither is not resident (reading it costs a load).
- `lora_loads_total{outcome}`: adapter loads from storage into host memory, `outcome="success"`
  (first loads and reloads after eviction) or `"failure"`.
- `lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}` = the scrape time
  (Unix seconds), vLLM's labels and value: the adapters of the running and waiting requests, each
  comma-separated (sorted here), and the number of compute slots. One series, the current one.
Exported only when the engine serves LoRA (its stats carry `max_lora`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIXES = ("loraserve:", "vllm:")
# Engine stats keys only this collector reads; the generic engine-stats export leaves them out.
OWN_KEYS = ("max_lora", "lora_adapters_loaded")
LEVELS = ("slot", "host")
_INFO_LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]


def _adapter_names(counts: Any) -> str:
    """Comma-separated names of the adapters with requests ("" is the base model: not an adapter)."""
    if not isinstance(counts, Mapping):
        return ""
    return ",".join(sorted(str(name) for name, count in counts.items() if name and count))


class LoRAMetricsCollector(Collector):
    """The LoRA metrics of the latest engine stats snapshot (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.snapshot: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Keep what this collector exports from `stats`; return the rest for the generic export."""
        self.snapshot = dict(stats)
        return {key: value for key, value in stats.items() if key not in OWN_KEYS}

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot
        max_lora = stats.get("max_lora")
        if not isinstance(max_lora, int):
            return
        loaded = stats.get("lora_adapters_loaded")
        loaded = loaded if isinstance(loaded, Mapping) else {}
        info_values = [
            str(max_lora),
            _adapter_names(stats.get("waiting_by_adapter")),
            _adapter_names(stats.get("running_by_adapter")),
        ]
        now = float(self._clock())
        for prefix in PREFIXES:
            residency = GaugeMetricFamily(
                prefix + "lora_adapter_loaded",
                "1 for each adapter resident at a level: a compute slot (slot) or host memory (host); "
                "an adapter in a slot is in host memory too.",
                labels=["lora_name", "level"],
            )
            for level in LEVELS:
                for name in loaded.get(level, ()):
                    residency.add_metric([str(name), level], 1.0)
            yield residency
            loads = CounterMetricFamily(
                prefix + "lora_loads",
                "Adapter loads from storage into host memory, first loads and reloads after eviction.",
                labels=["outcome"],
            )
            loads.add_metric(["success"], float(stats.get("lora_num_loads", 0)))
            loads.add_metric(["failure"], float(stats.get("lora_num_load_failures", 0)))
            yield loads
            info = GaugeMetricFamily(
                prefix + "lora_requests_info", "Running stats on lora requests.", labels=_INFO_LABELS
            )
            info.add_metric(info_values, now)
            yield info

    def describe(self) -> Iterator[Metric]:
        return iter(())
