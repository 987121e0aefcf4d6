"""vLLM's speculative-decoding counters from an engine's `stats()["spec_decode"]`
(`engine/spec_stats.py`): `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`, each with vLLM's labels
plus `lora_name` ("" is the base model), as loraserve labels its per-adapter gauges. Absent when the
engine does not speculate."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

SPEC_KEY = "spec_decode"
_COUNTERS = (
    ("num_drafts", "Number of spec decoding drafts."),
    ("num_draft_tokens", "Number of draft tokens."),
    ("num_accepted_tokens", "Number of accepted tokens."),
)


def spec_decode_families(
    stats: Mapping[str, Any], labels: Sequence[str], values: Sequence[str]
) -> Iterator[Metric]:
    """The four families, `labels` = `values` on every sample (vLLM's model_name and engine)."""
    by_adapter = stats.get(SPEC_KEY)
    if not isinstance(by_adapter, Mapping):
        return
    names = [*labels, "lora_name"]
    for key, doc in _COUNTERS:
        family = CounterMetricFamily("vllm:spec_decode_" + key, doc, labels=names)
        for adapter, counts in sorted(by_adapter.items()):
            family.add_metric([*values, str(adapter)], float(counts.get(key, 0)))
        yield family
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*names, "position"],
    )
    for adapter, counts in sorted(by_adapter.items()):
        for position, count in enumerate(counts.get("accepted_per_pos", ())):
            per_pos.add_metric([*values, str(adapter), str(position)], float(count))
    yield per_pos
