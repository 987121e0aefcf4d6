"""The engine's metrics snapshot: what `/metrics`, each replica's report and the router read."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from loraserve.engine.block_manager import BlockManager
from loraserve.engine.iteration_stats import IterationTokens
from loraserve.engine.scheduler import Scheduler
from loraserve.lora.mix import MIX_LABEL

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAManager
    from loraserve.lora.request import LoRARequest


def adapter_label(lora_request: LoRARequest | None) -> str:
    """The metrics' name of a request's adapter: "" for the base model, MIX_LABEL for a mix (a mix's
    name holds a client's weights: each would be a series of its own; an adapter literally named
    "(mix)" would share the label)."""
    if lora_request is None:
        return ""
    return MIX_LABEL if lora_request.is_mix else lora_request.lora_name


def engine_stats(
    scheduler: Scheduler,
    block_manager: BlockManager,
    num_step_failures: int,
    lora: LoRAManager | None,
    iteration_tokens: IterationTokens | None = None,
    cache_info: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Numbers (gauges; monotonic counters such as `num_step_failures`, `lora_num_loads`,
    `lora_num_load_failures`), `{adapter name: count}` maps (`running_by_adapter`,
    `waiting_by_adapter`; "" is the base model, MIX_LABEL every mix), and lists of new observations (`lora_load_seconds`,
    drained by each call). With LoRA: `max_lora` (the number of compute slots) and
    `lora_adapters_loaded` = {"slot": [names], "host": [names]} (`LoRAManager.resident_adapters`).
    vLLM's own: `iteration_tokens` (`IterationTokens.snapshot()`, cumulative) and `cache_config_info`
    (`iteration_stats.cache_config_info`)."""
    running, waiting = scheduler.running, scheduler.waiting
    stats: dict[str, Any] = {
        "num_running": len(running),
        "num_waiting": len(waiting),
        "running_by_adapter": dict(Counter(adapter_label(seq.request.lora_request) for seq in running)),
        "waiting_by_adapter": dict(Counter(adapter_label(seq.request.lora_request) for seq in waiting)),
        "num_preemptions": scheduler.num_preemptions,
        "num_step_failures": num_step_failures,
        "prefix_cache_queries": block_manager.num_prefix_queries,
        "prefix_cache_hits": block_manager.num_prefix_hits,
        "prefix_cache_query_tokens": block_manager.num_prefix_query_tokens,
        "prefix_cache_hit_tokens": block_manager.num_prefix_hit_tokens,
        "kv_blocks_free": block_manager.num_free_blocks,
        "kv_blocks_total": block_manager.num_blocks,
    }
    if iteration_tokens is not None:
        stats["iteration_tokens"] = iteration_tokens.snapshot()
    if cache_info is not None:
        stats["cache_config_info"] = dict(cache_info)
    if lora is not None:
        stats.update(lora.stats())  # its lists are observations new since the last call
        stats["max_lora"] = lora.lora_config.max_loras
        stats["lora_adapters_loaded"] = lora.resident_adapters()
    return stats


def residency_levels(resident: dict[str, list[str]]) -> dict[str, str]:
    """{"slot": names, "host": names} -> name -> its highest level ("slot" over "host")."""
    return {**{name: "host" for name in resident["host"]}, **{name: "slot" for name in resident["slot"]}}
