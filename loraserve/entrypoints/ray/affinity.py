"""Adapter-affinity routing policy: which replica should run a request for one adapter.

Pure and Ray-free, so that the Ray request router (`router.py`) and the cluster simulator
(`benchmarks/cluster_sim.py`) rank replicas with the very same code.

Order of preference for a request of adapter X:
1. a replica holding X in a compute slot (its next step needs no upload),
2. one holding X in host memory (an upload, no disk read),
3. the least loaded replica (a cold load from the adapter store).
A hot adapter spreads: once every replica holding it has `spread_queue_depth` of its requests in
flight, the least loaded replica without it takes the next one (and holds it from then on), so one
adapter never queues behind a single replica while others idle.
"X" is one content version ("name@<12 digest digits>", `LoRARequest.version_key`): replicas report
residency under those keys, so a replica that holds only the previous version of a name is no
holder of the new one (`replica_load`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SLOT = "slot"
HOST = "host"
# Default for --replica-spread-queue-depth: about one decode batch of one adapter on a CPU replica;
# below it, keeping an adapter on one replica is cheaper than loading it on another.
DEFAULT_SPREAD_QUEUE_DEPTH = 8
# How long a request waits for its first-rank replica before the fallback ranks may take it. Ray
# probes a replica's queue length with a 0.1 s deadline (doubling per retry, up to 1 s) and moves on
# to the next rank when the probe is late: on a loaded machine a replica busy in a step misses it, and
# the request would load its adapter on a second replica. A dead replica leaves the candidates at
# once (Ray drops it on ActorDiedError), so only a live but unresponsive one costs this wait.
# Ray's own multiplexed matching waits 1-2 s; a cold adapter load costs more than that.
AFFINITY_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the router knows of one replica when it routes a request of one adapter."""

    replica_id: str
    num_in_flight: int  # requests on the replica, every adapter
    num_adapter_in_flight: int = 0  # requests of this adapter on it
    residency: str | None = None  # SLOT, HOST, or None when the adapter is not in its memory


def known_residency(
    reported: str | None, report_time: float, sent_at: float | None, grace_s: float
) -> str | None:
    """Where the router should believe an adapter is on one replica: the replica's report, unless the
    router sent the adapter there after (`grace_s` before) that report was taken: then it is on its
    way into a slot there, whatever the older report says."""
    if reported is not None:
        return reported
    if sent_at is not None and sent_at >= report_time - grace_s:
        return SLOT
    return None


def replica_load(
    replica_id: str,
    queue_len: int,
    report: dict[str, Any] | None,
    model_id: str,
    sent_at: float | None = None,
    num_adapter_in_flight: int = 0,
    grace_s: float = 1.0,
) -> ReplicaLoad:
    """What the router knows of one replica for a request of `model_id` (a version key, "" for the
    base model): the replica's last `report` (`EngineReplica.record_routing_stats`: "time" and
    "residency" by version key), when the router last sent `model_id` there and how many of its
    requests it has in flight there. Only the report's entry for this very key counts."""
    if not model_id:
        return ReplicaLoad(replica_id, queue_len)
    report = report or {}
    residency = known_residency(
        (report.get("residency") or {}).get(model_id), float(report.get("time", 0.0)), sent_at, grace_s
    )
    if residency is None and num_adapter_in_flight > 0:  # its requests are there: it is loading it
        residency = SLOT
    return ReplicaLoad(replica_id, queue_len, num_adapter_in_flight, residency)


def _holder_order(replica: ReplicaLoad) -> tuple[bool, int, str]:
    return (replica.residency != SLOT, replica.num_in_flight, replica.replica_id)


def _load_order(replica: ReplicaLoad) -> tuple[int, str]:
    return (replica.num_in_flight, replica.replica_id)


def rank_replicas(
    replicas: Sequence[ReplicaLoad], spread_queue_depth: int = DEFAULT_SPREAD_QUEUE_DEPTH
) -> list[list[str]]:
    """Replica ids in ranks, most preferred first: the first rank is the one replica this request
    should go to; later ranks are fallbacks when it has no room. Empty when there is no replica.

    Ties break on the replica id, so the same state always gives the same answer."""
    holders = sorted((r for r in replicas if r.residency), key=_holder_order)
    others = sorted((r for r in replicas if not r.residency), key=_load_order)
    open_holders = [r for r in holders if r.num_adapter_in_flight < spread_queue_depth]
    if open_holders:
        first = open_holders[0]
    elif others:  # every holder is deep in this adapter's requests: one more replica takes it on
        first = others[0]
    elif holders:
        first = min(holders, key=_load_order)
    else:
        return []
    ranks = [[first.replica_id]]
    rest_holders = [r.replica_id for r in holders if r is not first]
    rest_others = [r.replica_id for r in others if r is not first]
    if rest_holders:
        ranks.append(rest_holders)
    if rest_others:
        ranks.append(rest_others)
    return ranks


def ranks_to_offer(ranks: list[list[str]], waited_s: float, affinity_wait_s: float = AFFINITY_WAIT_S) -> list[list[str]]:
    """The ranks to hand Ray for a request that has waited `waited_s` to be routed: only the first
    (the replica this policy chose) until `affinity_wait_s`, then every rank, in order."""
    return ranks if waited_s >= affinity_wait_s else ranks[:1]


def rank_without_adapter(replicas: Sequence[ReplicaLoad]) -> list[list[str]]:
    """The base model (no adapter): every replica serves it equally well, so the least loaded."""
    ordered = sorted(replicas, key=_load_order)
    return [[r.replica_id for r in ordered]] if ordered else []
