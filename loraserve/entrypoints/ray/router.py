"""`AffinityRouter`: Ray Serve's request router for the engine replicas, ranking them by adapter affinity.

It runs inside the process that holds the deployment handle (the HTTP ingress). The request's
multiplexed model id is its adapter's version key, "name@<12 digest digits>" ("" for the base model),
and replicas report residency under the same keys: a replica holding only another version of the
name is no holder of this one (it would load this version cold, and refuses to serve other content
for it). `affinity.rank_replicas` decides.

What it knows of each replica, freshest first:
- the requests it routed there itself and that have not completed, per adapter (exact, instant);
- the replica's own report (`EngineReplica.record_routing_stats`, every few seconds through the Serve
  controller): which adapters sit in a slot or in host memory;
- the adapters it routed there since that report was taken (counted as in a slot: the replica loads
  them for the request), so the next request of a new adapter follows the first one at once.
Ray's per-replica queue length (ongoing requests) is the load.

A model id `TARGET_PREFIX + replica id` pins a call to that one replica: the client uses it to reach
every replica (adapter removal).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loraserve.entrypoints.ray.affinity import (
    DEFAULT_SPREAD_QUEUE_DEPTH,
    ReplicaLoad,
    rank_replicas,
    rank_without_adapter,
    ranks_to_offer,
    replica_load,
)
from loraserve.entrypoints.ray.known_replicas import track_router

TARGET_PREFIX = "@replica:"
# A report taken this long after the router sent an adapter somewhere overrides the router's memory of
# it (the replica counts the adapter from the moment the request reaches it, so this only needs to
# cover the dispatch).
REPORT_GRACE_S = 1.0
MAX_REMEMBERED = 100_000  # (adapter, replica) pairs the router remembers sending; oldest dropped first

class AffinityRouter(RequestRouter):
    def initialize_state(self, spread_queue_depth: int = DEFAULT_SPREAD_QUEUE_DEPTH, **_: Any) -> None:
        self.spread_queue_depth = spread_queue_depth
        self._sent: OrderedDict[tuple[str, str], float] = OrderedDict()  # (adapter, replica) -> when
        self._in_flight: Counter[tuple[str, str]] = Counter()
        self._requests: dict[str, tuple[str, str]] = {}  # internal request id -> (adapter, replica)
        track_router(self)  # for known_replica_ids (see known_replicas.py: this class is pickled by value)

    def replica_ids(self) -> list[str]:
        return [replica_id.unique_id for replica_id in list(self._replicas)]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        waited_s = time.time() - pending_request.created_at if pending_request is not None else 0.0
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if adapter.startswith(TARGET_PREFIX):
            target = by_id.get(adapter.removeprefix(TARGET_PREFIX))
            return [[target]] if target is not None else []
        loads = [self._load_of(r, adapter) for r in candidate_replicas]
        ranks = rank_replicas(loads, self.spread_queue_depth) if adapter else rank_without_adapter(loads)
        if adapter and ranks:
            # Remembered now, not when Ray reports the request routed: a second request of a cold
            # adapter chosen meanwhile would otherwise load it on another replica too. A replica
            # that did not take the request is corrected by its next report.
            self.note_sent(adapter, ranks[0][0])
            # Ray calls again (with a longer probe deadline) when the first rank does not answer.
            ranks = ranks_to_offer(ranks, waited_s)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def _load_of(self, replica: RunningReplica, adapter: str) -> ReplicaLoad:
        rid = replica.replica_id.unique_id
        queue_len = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return replica_load(
            rid, queue_len, replica.routing_stats, adapter, self._sent.get((adapter, rid)),
            self._in_flight[(adapter, rid)], REPORT_GRACE_S,
        )  # fmt: skip

    def note_sent(self, adapter: str, replica_id: str) -> None:
        """Remember that `replica_id` holds `adapter` from now (a request routed there, or a load)."""
        key = (adapter, replica_id)
        self._sent[key] = time.time()
        self._sent.move_to_end(key)
        while len(self._sent) > MAX_REMEMBERED:
            self._sent.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        adapter = pending_request.metadata.multiplexed_model_id
        if not adapter or adapter.startswith(TARGET_PREFIX):
            return
        key = (adapter, replica_id.unique_id)
        self.note_sent(*key)
        self._in_flight[key] += 1
        self._requests[pending_request.metadata.internal_request_id] = key

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = self._requests.pop(internal_request_id, None)
        if key is not None:
            # A finished request had its adapter loaded there: newer than a report taken while a slow
            # (resolver) load was still running, which would otherwise make the adapter look cold.
            self.note_sent(*key)
            self._in_flight[key] -= 1
            if self._in_flight[key] <= 0:
                del self._in_flight[key]
