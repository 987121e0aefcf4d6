"""The adapter-affinity policy of `--replicas` (pure: no Ray): slot, then host, then least loaded;
a hot adapter spreads past the queue depth; the router's memory of where it sent an adapter."""

from __future__ import annotations

from loraserve.entrypoints.openai.cli.server_config import DEFAULT_SPREAD_QUEUE_DEPTH as FLAG_DEFAULT
from loraserve.entrypoints.ray.affinity import (
    DEFAULT_SPREAD_QUEUE_DEPTH,
    HOST,
    SLOT,
    ReplicaLoad,
    known_residency,
    rank_replicas,
    rank_without_adapter,
    ranks_to_offer,
)


def test_slot_holder_first_even_when_busier() -> None:
    loads = [
        ReplicaLoad("idle", 0),
        ReplicaLoad("host", 2, residency=HOST),
        ReplicaLoad("slot", 5, num_adapter_in_flight=1, residency=SLOT),
    ]
    assert rank_replicas(loads, spread_queue_depth=4) == [["slot"], ["host"], ["idle"]]


def test_host_holder_before_a_cold_replica() -> None:
    loads = [ReplicaLoad("cold", 0), ReplicaLoad("host", 3, residency=HOST)]
    assert rank_replicas(loads)[0] == ["host"]


def test_no_holder_goes_to_the_least_loaded_with_a_stable_tie_break() -> None:
    loads = [ReplicaLoad("b", 1), ReplicaLoad("c", 4), ReplicaLoad("a", 1)]
    assert rank_replicas(loads) == [["a"], ["b", "c"]]
    assert rank_replicas(list(reversed(loads))) == [["a"], ["b", "c"]]


def test_hot_adapter_spreads_once_its_home_queue_is_deep() -> None:
    home = ReplicaLoad("home", 9, num_adapter_in_flight=3, residency=SLOT)
    loads = [home, ReplicaLoad("busy", 7), ReplicaLoad("free", 2)]
    assert rank_replicas(loads, spread_queue_depth=4)[0] == ["home"]
    deep = ReplicaLoad("home", 10, num_adapter_in_flight=4, residency=SLOT)
    assert rank_replicas([deep, *loads[1:]], spread_queue_depth=4) == [["free"], ["home"], ["busy"]]


def test_spread_adapter_fills_the_least_loaded_open_holder() -> None:
    loads = [
        ReplicaLoad("home", 10, num_adapter_in_flight=4, residency=SLOT),
        ReplicaLoad("second", 3, num_adapter_in_flight=1, residency=SLOT),
        ReplicaLoad("other", 0),
    ]
    assert rank_replicas(loads, spread_queue_depth=4)[0] == ["second"]


def test_every_replica_deep_in_the_adapter_takes_the_least_loaded() -> None:
    loads = [
        ReplicaLoad("a", 12, num_adapter_in_flight=8, residency=SLOT),
        ReplicaLoad("b", 9, num_adapter_in_flight=8, residency=HOST),
    ]
    assert rank_replicas(loads, spread_queue_depth=8)[0] == ["b"]


def test_no_replicas_no_ranks() -> None:
    assert rank_replicas([]) == []
    assert rank_without_adapter([]) == []


def test_base_model_ranks_every_replica_by_load() -> None:
    loads = [ReplicaLoad("x", 3, residency=SLOT), ReplicaLoad("y", 1)]
    assert rank_without_adapter(loads) == [["y", "x"]]


def test_router_memory_counts_until_a_newer_report() -> None:
    # Sent after the last report: on its way into a slot there.
    assert known_residency(None, report_time=100.0, sent_at=101.0, grace_s=1.0) == SLOT
    # Sent just before the report was taken: the report may not show it yet.
    assert known_residency(None, report_time=100.0, sent_at=99.5, grace_s=1.0) == SLOT
    # A report well after the send no longer holds it: evicted.
    assert known_residency(None, report_time=100.0, sent_at=90.0, grace_s=1.0) is None
    assert known_residency(HOST, report_time=100.0, sent_at=None, grace_s=1.0) == HOST
    assert known_residency(None, report_time=0.0, sent_at=None, grace_s=1.0) is None


def test_flag_default_is_the_policy_default() -> None:
    assert FLAG_DEFAULT == DEFAULT_SPREAD_QUEUE_DEPTH


def test_only_the_chosen_replica_is_offered_until_the_affinity_wait() -> None:
    """Ray moves to the next rank when the first one's queue-length probe is late (a busy replica on
    a loaded machine): offering it would load the adapter on a second replica."""
    ranks = rank_replicas([ReplicaLoad("home", 3, 1, residency=SLOT), ReplicaLoad("other", 0)])
    assert ranks_to_offer(ranks, waited_s=0.0, affinity_wait_s=5.0) == [["home"]]
    assert ranks_to_offer(ranks, waited_s=4.9, affinity_wait_s=5.0) == [["home"]]
    assert ranks_to_offer(ranks, waited_s=5.0, affinity_wait_s=5.0) == [["home"], ["other"]]
    assert ranks_to_offer([], waited_s=0.0) == []
