"""One engine's `stats()` dict as Prometheus metric families, optionally with extra labels.

The single server exports its engine's stats with no extra label; the `--replicas` ingress exports
every replica's with `replica=<id>`. Both go through `stats_families`, and `merge_families` joins the
families of several engines that share a name into one (Prometheus allows each name once).

The generic export: numbers become gauges (counters for the monotonic keys in `_COUNTERS`, exported
with Prometheus' `_total` suffix), `{adapter: count}` maps become gauges labelled `lora_name` ("" is
the base model). Lists (new observations) are not families: `metrics.py` adds them to histograms named
by `metric_name`. The LoRA residency and request-info metrics are `lora_metrics.py`'s; the iteration
tokens, the cache config and speculative decoding's counters are vLLM's only (`vllm_metrics.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraserve.entrypoints.openai.metrics.lora_metrics import OWN_KEYS, lora_families
from loraserve.entrypoints.openai.metrics.vllm_metrics import ENGINE_OWN_KEYS

PREFIX = "loraserve:"
# Engine stats keys with a fixed public name; any other key is exported as PREFIX + key.
_RENAMED = {
    "num_running": "num_requests_running",
    "num_waiting": "num_requests_waiting",
    "running_by_adapter": "num_requests_running_by_lora",
    "waiting_by_adapter": "num_requests_waiting_by_lora",
}
# Engine stats keys that only ever grow: exported as counters, so rate() and alerts work on them.
_COUNTERS = {
    "num_step_failures": "Engine steps that raised; their requests failed, the engine went on.",
    "num_request_failures": "Requests whose own sampling or beam round raised; they failed alone, their batch went on.",
    "grammar_compiles": "Grammars compiled by the compile worker processes.",
    "grammar_compile_timeouts": "Grammar compiles killed at --structured-outputs-compile-timeout (a 400 each).",
    "grammar_compiles_cancelled": "Grammar compiles withdrawn because their requests went away.",
    "grammar_compile_workers_started": "Grammar compile worker processes started (a killed one is replaced).",
}


def metric_name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", _RENAMED.get(key, key))


def _generic_families(stats: Mapping[str, Any], extra: Mapping[str, str]) -> Iterator[Metric]:
    names, values = list(extra), list(extra.values())
    for key, value in sorted(stats.items()):
        if key in OWN_KEYS or key in ENGINE_OWN_KEYS:
            continue
        name = metric_name(key)
        family: GaugeMetricFamily | CounterMetricFamily
        if key in _COUNTERS and isinstance(value, (int, float)):
            family = CounterMetricFamily(name, _COUNTERS[key], labels=names)
            family.add_metric(values, float(value))
        elif isinstance(value, (bool, int, float)):
            family = GaugeMetricFamily(name, f"Engine stat {key}.", labels=names)
            family.add_metric(values, float(value))
        elif isinstance(value, Mapping):
            family = GaugeMetricFamily(name, f"Engine stat {key}, per adapter.", labels=["lora_name", *names])
            for label, count in sorted(value.items(), key=lambda kv: str(kv[0])):
                if isinstance(count, (int, float)):
                    family.add_metric([str(label or ""), *values], float(count))
        else:  # lists are histogram observations (metrics.py); anything else has no metric
            continue
        yield family


def stats_families(
    stats: Mapping[str, Any], now: float, extra: Mapping[str, str] | None = None
) -> list[Metric]:
    """Every family of one engine's stats; `extra` (label name -> value) is added to each sample, and
    `now` is the value of `lora_requests_info` (vLLM's scrape time)."""
    extra = dict(extra or {})
    return [*_generic_families(stats, extra), *lora_families(stats, now, extra)]


def merge_families(families: Iterable[Metric]) -> list[Metric]:
    """Families with the same name joined into the first one (its help and type), in first-seen order."""
    merged: dict[str, Metric] = {}
    for family in families:
        first = merged.setdefault(family.name, family)
        if first is not family:
            first.samples.extend(family.samples)
    return list(merged.values())
