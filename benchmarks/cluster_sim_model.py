"""The discrete-event model behind benchmarks/cluster_sim.py: R engine replicas, A adapters.

Each replica is the engine in miniature: a host cache (`max_cpu_loras`, the engine's own `LRUCache`
under `eviction` "lru" or "cost", weighing each adapter by its load seconds) filled by `num_loaders`
loaders (`cold_load_s` per adapter, off the step loop, one read per adapter however many ask; with
`rank_mix` an adapter's load scales with its rank, 8/16/32/64 in turn, and a `remote_fraction` of
the adapters sit on a store `remote_factor` times slower), a
slot table (LRU, `max_loras`), and continuous batching: at each step boundary waiting requests join
in arrival order while the batch has room (`max_num_seqs`) and slots for their adapters; a step costs
`Costs.step_s(batch, prompt tokens of the joining requests, slot uploads)` and gives each sequence one
token. A request's first token comes at the end of its first step (TTFT).

Routing sees each replica's true state at arrival (an idealised router: the real one reads reports
every 2 s plus its own memory of where it sent adapters). Affinity ranks with the very code the Ray
router runs (`loraserve.entrypoints.ray.affinity.rank_replicas`).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from benchmarks.cluster_costs import Costs
from loraserve.entrypoints.ray.affinity import HOST, SLOT, ReplicaLoad, rank_replicas
from loraserve.lora.lru import LRUCache

POLICIES = ("random", "p2c", "affinity")


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_replicas: int
    num_adapters: int
    policy: str
    rate_per_s: float  # Poisson arrivals, the whole cluster
    num_requests: int
    zipf_s: float = 1.0
    prompt_len: int = 64
    gen_len: int = 32
    max_loras: int = 16
    max_cpu_loras: int = 64
    max_num_seqs: int = 64
    num_loaders: int = (
        1  # adapter loads one replica runs at once (CPU-bound locally; more for a remote store)
    )
    spread_queue_depth: int = 8
    warmup_fraction: float = 0.2  # requests arriving in this first part are not measured
    seed: int = 0
    eviction: str = "lru"  # the host cache's policy (LoRAConfig.lora_eviction_policy)
    rank_mix: bool = False  # adapter a has rank RANKS[a % 4]; its load takes rank / 8 x cold_load_s
    remote_fraction: float = 0.0  # adapters on the slow store: every (1 / fraction)-th, by index
    remote_factor: float = 1.0  # how much slower a load from that store is

    def load_s(self, adapter: int, cold_load_s: float) -> float:
        """Seconds to load `adapter` into host memory."""
        seconds = cold_load_s * (RANKS[adapter % len(RANKS)] / RANKS[0] if self.rank_mix else 1.0)
        remote = self.remote_fraction > 0 and (adapter // 4) % round(1 / self.remote_fraction) == 0
        return seconds * (self.remote_factor if remote else 1.0)


RANKS = (8, 16, 32, 64)


@dataclass(slots=True)
class SimRequest:
    arrival: float
    adapter: int
    tokens_left: int
    is_hit: bool = False
    first_token_at: float | None = None


@dataclass(slots=True)
class Replica:
    index: int
    host: LRUCache[int, float] = field(default_factory=lambda: LRUCache(1 << 30))  # adapter -> load seconds
    slots: OrderedDict[int, None] = field(default_factory=OrderedDict)
    loading: dict[int, list[SimRequest]] = field(default_factory=dict)
    loaders_free_at: list[float] = field(default_factory=list)  # a heap, one entry per loader
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    is_stepping: bool = False
    num_in_flight: int = 0
    adapter_in_flight: Counter[int] = field(default_factory=Counter)

    def residency(self, adapter: int) -> str | None:
        if adapter in self.slots or adapter in self.loading:  # a load in progress ends in a slot
            return SLOT
        return HOST if adapter in self.host else None


def make_trace(config: SimConfig, rng: random.Random) -> list[tuple[float, int]]:
    """Poisson arrivals at `rate_per_s`, each for an adapter drawn from Zipf(`zipf_s`) popularity."""
    weights = list(accumulate(1.0 / (rank + 1) ** config.zipf_s for rank in range(config.num_adapters)))
    trace, now = [], 0.0
    for _ in range(config.num_requests):
        now += rng.expovariate(config.rate_per_s)
        trace.append((now, rng.choices(range(config.num_adapters), cum_weights=weights)[0]))
    return trace


class Cluster:
    def __init__(self, config: SimConfig, costs: Costs) -> None:
        self.config, self.costs = config, costs
        self.rng = random.Random(config.seed)
        self.replicas = [
            Replica(i, LRUCache(1 << 30, None, config.eviction, lambda _, load_s: load_s),
                    loaders_free_at=[0.0] * config.num_loaders)
            for i in range(config.num_replicas)
        ]  # fmt: skip
        self.load_seconds: list[tuple[float, float]] = []  # (start, store seconds) of each cold load
        self.holders: dict[int, set[int]] = {}  # adapter -> replicas holding or loading it
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.finished: list[SimRequest] = []
        self.loads: list[float] = []  # when each cold load started
        self.tokens: list[tuple[float, int]] = []  # (step end, tokens produced)

    def push(self, at: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def run(self, trace: list[tuple[float, int]] | None = None) -> None:
        """Simulate `trace` ((arrival time, adapter index) pairs), or the config's own Poisson trace."""
        for at, adapter in trace if trace is not None else make_trace(self.config, self.rng):
            self.push(at, "arrive", SimRequest(at, adapter, self.config.gen_len))
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(at, payload)
            elif kind == "loaded":
                self.loaded(at, *payload)
            else:
                self.step_done(at, *payload)

    # ---- routing ----------------------------------------------------------------------------------
    def choose(self, adapter: int) -> Replica:
        replicas, policy = self.replicas, self.config.policy
        if policy == "random":
            return self.rng.choice(replicas)
        if policy == "p2c":
            a, b = self.rng.sample(replicas, 2) if len(replicas) > 1 else (replicas[0], replicas[0])
            return a if a.num_in_flight <= b.num_in_flight else b
        holders = self.holders.get(adapter, set())
        others = [r for r in replicas if r.index not in holders]
        candidates = [replicas[i] for i in holders]
        if others:  # only the least loaded replica without the adapter can rank first among them
            candidates.append(min(others, key=lambda r: (r.num_in_flight, r.index)))
        loads = [
            ReplicaLoad(f"{r.index:04d}", r.num_in_flight, r.adapter_in_flight[adapter], r.residency(adapter))
            for r in candidates
        ]
        return replicas[int(rank_replicas(loads, self.config.spread_queue_depth)[0][0])]

    # ---- one replica --------------------------------------------------------------------------------
    def arrive(self, now: float, request: SimRequest) -> None:
        replica = self.choose(request.adapter)
        replica.num_in_flight += 1
        replica.adapter_in_flight[request.adapter] += 1
        adapter = request.adapter
        if adapter in replica.host:
            request.is_hit = True
            replica.host.get(adapter)
            replica.waiting.append(request)
            self.maybe_step(now, replica)
        elif adapter in replica.loading:
            replica.loading[adapter].append(request)
        else:
            load_s = self.config.load_s(adapter, self.costs.cold_load_s)
            self.load_seconds.append((now, load_s))
            done = max(now, heapq.heappop(replica.loaders_free_at)) + load_s
            heapq.heappush(replica.loaders_free_at, done)
            replica.loading[adapter] = [request]
            self.holders.setdefault(adapter, set()).add(replica.index)
            self.loads.append(now)
            self.push(done, "loaded", (replica, adapter))

    def loaded(self, now: float, replica: Replica, adapter: int) -> None:
        replica.host.put(adapter, self.config.load_s(adapter, self.costs.cold_load_s))
        busy = (
            {r.adapter for r in replica.running} | {r.adapter for r in replica.waiting} | set(replica.loading)
        )
        while len(replica.host) > self.config.max_cpu_loras:
            old = replica.host.victim(busy)  # adapters with requests stay (the cache may overflow meanwhile)
            if old is None:
                break
            replica.host.evict(old)
            replica.slots.pop(old, None)
            self.holders[old].discard(replica.index)
        replica.waiting.extend(replica.loading.pop(adapter))
        self.maybe_step(now, replica)

    def maybe_step(self, now: float, replica: Replica) -> None:
        if replica.is_stepping or not (replica.waiting or replica.running):
            return
        c = self.config
        active = {r.adapter for r in replica.running}
        joining: list[SimRequest] = []
        still_waiting: deque[SimRequest] = deque()
        for request in replica.waiting:
            fits = len(replica.running) + len(joining) < c.max_num_seqs
            if fits and (request.adapter in active or len(active) < c.max_loras):
                active.add(request.adapter)
                joining.append(request)
            else:
                still_waiting.append(request)
        replica.waiting = still_waiting
        uploads = [a for a in active if a not in replica.slots]
        for adapter in active:
            replica.slots[adapter] = None
            replica.slots.move_to_end(adapter)
        for old in list(replica.slots):
            if len(replica.slots) <= c.max_loras:
                break
            if old not in active:
                del replica.slots[old]
        batch = replica.running + joining
        if not batch:
            return
        replica.is_stepping = True
        duration = self.costs.step_s(len(batch), c.prompt_len * len(joining), len(uploads))
        self.push(now + duration, "step", (replica, batch))

    def step_done(self, now: float, replica: Replica, batch: list[SimRequest]) -> None:
        replica.is_stepping = False
        replica.running = []
        for request in batch:
            request.tokens_left -= 1
            if request.first_token_at is None:
                request.first_token_at = now
            if request.tokens_left > 0:
                replica.running.append(request)
            else:
                replica.num_in_flight -= 1
                replica.adapter_in_flight[request.adapter] -= 1
                self.finished.append(request)
        self.tokens.append((now, len(batch)))
        self.maybe_step(now, replica)
