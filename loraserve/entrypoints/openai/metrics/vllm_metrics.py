"""vLLM's Prometheus metrics, under vLLM's names and label sets, beside loraserve's own.

vLLM's Grafana dashboard, KServe and llm-d read these names: every series carries `model_name` (the
first served name) and `engine` ("0"; behind `--replicas` the replica id, one engine per replica).
`VllmRequestMetrics` holds what the serving layer observes per request (token counters, successes by
finish reason, the latency histograms: TTFT, inter-token, end to end, queue, prefill, decode,
inference; prompt / generation length and n / max_tokens histograms); `vllm_engine_families` turns one
engine's `stats()` into vLLM's gauges and counters (running / waiting requests, KV-cache usage, prefix
cache queries and hits in tokens, preemptions, speculative decoding's: `spec_metrics.py`), the
`iteration_tokens_total` histogram (tokens per engine step, the engine's cumulative bucket counts) and
the `cache_config_info` info gauge (vLLM's labels: the cache config's fields and `engine`, no
`model_name`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from loraserve.entrypoints.openai.metrics.spec_metrics import SPEC_KEY, spec_decode_families

VLLM = "vllm:"
LABELS = ["model_name", "engine"]
ENGINE = "0"  # vLLM's engine index of a single-engine server
# Engine stats keys that only vLLM's families export (structured values, not generic gauges).
ENGINE_OWN_KEYS = ("iteration_tokens", "cache_config_info", SPEC_KEY)
# vLLM's buckets (v0.11 vllm/v1/metrics/loggers.py), so dashboards' quantiles match.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0)  # fmt: skip
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
            240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N = (1, 2, 5, 10, 20)


class VllmRequestMetrics:
    """The per-request series; `observe_*` are called by the serving layer."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.labels = (model_name, ENGINE)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(VLLM + name, doc, [*LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(VLLM + name, doc, LABELS, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL
        )
        self.tpot = histogram(
            "time_per_output_token_seconds", "Histogram of time per output token in seconds.", _ITL
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _REQUEST
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _REQUEST
        )
        self.decode = histogram(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _REQUEST
        )
        self.inference = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST,
        )
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS)
        self.generation_len = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", _TOKENS
        )
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", _N)
        self.params_max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKENS)  # fmt: skip

    def observe_tokens(self, first: bool, seconds: float) -> None:
        """A token-producing output: the first one's TTFT, or the gap since the previous one."""
        if first:
            self.ttft.labels(*self.labels).observe(seconds)
        else:
            self.itl.labels(*self.labels).observe(seconds)
            self.tpot.labels(*self.labels).observe(seconds)

    def observe_finished(self, finished: FinishedRequest) -> None:
        """A request's end: its counters, lengths and phase times (wall clock, time.time())."""
        labels = self.labels
        self.prompt_tokens.labels(*labels).inc(finished.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(finished.num_generation_tokens)
        self.request_success.labels(*labels, finished.finish_reason).inc()
        self.prompt_len.labels(*labels).observe(finished.num_prompt_tokens)
        self.generation_len.labels(*labels).observe(finished.num_generation_tokens)
        self.params_n.labels(*labels).observe(finished.n)
        self.params_max_tokens.labels(*labels).observe(finished.max_tokens)
        self.e2e.labels(*labels).observe(max(finished.finished - finished.arrival, 0.0))
        scheduled, first_token = finished.first_scheduled, finished.first_token
        if scheduled is not None:
            self.queue.labels(*labels).observe(max(scheduled - finished.arrival, 0.0))
            self.inference.labels(*labels).observe(max(finished.finished - scheduled, 0.0))
            if first_token is not None:
                self.prefill.labels(*labels).observe(max(first_token - scheduled, 0.0))
        if first_token is not None:
            self.decode.labels(*labels).observe(max(finished.finished - first_token, 0.0))


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What one finished engine request contributes (times are time.time() seconds)."""

    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str
    n: int
    max_tokens: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float


_GAUGES = {"num_running": "num_requests_running", "num_waiting": "num_requests_waiting"}
_COUNTERS = {
    "prefix_cache_query_tokens": ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("num_preemptions", "Cumulative number of preemption from the engine."),
}  # fmt: skip


def vllm_engine_families(stats: Mapping[str, Any], model_name: str, engine: str = ENGINE) -> Iterator[Metric]:
    """vLLM's engine gauges and counters from one engine's `stats()`."""
    values = [model_name, engine]
    for key, name in _GAUGES.items():
        if isinstance(stats.get(key), (int, float)):
            family = GaugeMetricFamily(
                VLLM + name, f"Number of requests in {name[13:].upper()} state.", labels=LABELS
            )
            family.add_metric(values, float(stats[key]))
            yield family
    total, free = stats.get("kv_blocks_total"), stats.get("kv_blocks_free")
    if isinstance(total, (int, float)) and isinstance(free, (int, float)) and total > 0:
        family = GaugeMetricFamily(
            VLLM + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABELS
        )
        family.add_metric(values, 1.0 - float(free) / float(total))  # vLLM's: cached free blocks are free
        yield family
    for key, (name, doc) in _COUNTERS.items():
        if isinstance(stats.get(key), (int, float)):
            counter = CounterMetricFamily(VLLM + name, doc, labels=LABELS)
            counter.add_metric(values, float(stats[key]))
            yield counter
    yield from spec_decode_families(stats, LABELS, values)
    yield from _iteration_tokens(stats.get("iteration_tokens"), values)
    yield from _cache_config_info(stats.get("cache_config_info"), engine)


def _iteration_tokens(snapshot: Any, values: list[str]) -> Iterator[Metric]:
    """`IterationTokens.snapshot()` as vLLM's histogram (cumulative buckets, +Inf last)."""
    if not isinstance(snapshot, Mapping):
        return
    bounds, counts = list(snapshot.get("buckets") or []), list(snapshot.get("counts") or [])
    if len(counts) != len(bounds) + 1:
        return
    family = HistogramMetricFamily(
        VLLM + "iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=LABELS
    )
    cumulative, running = [], 0
    for bound, count in zip([*bounds, float("inf")], counts, strict=True):
        running += int(count)
        cumulative.append((floatToGoString(float(bound)), float(running)))
    family.add_metric(values, cumulative, float(snapshot.get("sum", 0)))
    yield family


def _cache_config_info(info: Any, engine: str) -> Iterator[Metric]:
    """vLLM's info gauge: 1, labelled with the cache config's fields (strings) and the engine."""
    if not isinstance(info, Mapping) or not info:
        return
    names = [str(key) for key in info]
    family = GaugeMetricFamily(
        VLLM + "cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*names, "engine"]
    )
    family.add_metric([str(value) for value in info.values()] + [engine], 1.0)
    yield family
