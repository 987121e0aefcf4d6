"""`EngineReplica`: one engine (`AsyncLLMEngine`) as a Ray Serve replica, behind the HTTP ingress.

Replicas share nothing but the adapter store: each request carries its full `LoRARequest` (name, id
and path, assigned by the ingress), and a replica registers an adapter the first time a request
needs it. A replica reports which adapter versions it holds (slot or host memory, keyed
"name@<12 digest digits>" as the router's model ids are) and how many requests it runs per version
to the router (`record_routing_stats`); a dead engine fails its health check, so Serve replaces the
replica. Loads answer with the content digest the replica registered, which the ingress then pins
every request of that version to.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from loraserve.beam_search import BeamSearchParams
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.entrypoints.ray.replica_adapters import local_adapter
from loraserve.lora.request import LoRARequest
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the ingress needs of the engine to validate and tokenize requests (as `EngineClient`)."""

    model_config: Any
    lora_config: Any
    scheduler_config: Any
    tokenizer: Any


@dataclass(frozen=True, slots=True)
class ReplicaHello:
    """The first item of every stream: which replica runs the request (for x-loraserve-replica)."""

    replica_id: str


class EngineReplica:
    async def __init__(self, engine_args: EngineArgs, logging_level: str | None = None) -> None:  # type: ignore[misc]
        # Ray supports an async constructor; the engine thread must start on the replica's loop.
        import logging

        from ray import serve

        from loraserve.plugins import load_general_plugins

        if logging_level:
            logging.basicConfig(level=logging_level, format="%(levelname)s %(name)s: %(message)s")
        load_general_plugins()  # model architectures and resolvers registered by plugins
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncLLMEngine.from_engine_args(engine_args)
        await self.engine.start()
        self._in_flight: Counter[str] = Counter()  # version key ("" base) -> requests inside generate

    async def info(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(engine.model_config, engine.lora_config, engine.scheduler_config, engine.tokenizer)

    async def generate(
        self,
        prompt: list[int] | dict[str, Any],
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        group_id: str | None = None,
        priority: int = 0,
        client_id: str | None = None,
    ) -> AsyncIterator[ReplicaHello | RequestOutput]:
        yield ReplicaHello(self.replica_id)
        if lora_request is not None:
            lora_request = await local_adapter(lora_request, self.engine.model_config.model)
        name = lora_request.version_key if lora_request is not None else ""
        self._in_flight[name] += 1  # counted as resident from now: the router sends its next ones here
        try:
            outputs = self.engine.generate(
                prompt, sampling_params, request_id, lora_request, group_id, priority, client_id
            )
            async for output in outputs:
                yield output
        finally:
            self._in_flight[name] -= 1
            if self._in_flight[name] <= 0:
                del self._in_flight[name]

    async def check_admission(self, num_seqs: int, num_prefill_tokens: int) -> str:
        await self.engine.check_admission(num_seqs, num_prefill_tokens)
        return self.replica_id

    async def add_lora(self, lora_request: LoRARequest) -> tuple[str, bool, str]:
        """(this replica, added, the content digest registered)."""
        local = await local_adapter(lora_request, self.engine.model_config.model)
        added = await self.engine.add_lora(local)
        return self.replica_id, added, await self.engine.lora_digest(lora_request.lora_id)

    async def replace_lora(self, old_lora_id: int, lora_request: LoRARequest) -> tuple[str, bool, str]:
        if not self.engine.engine.is_lora_registered(old_lora_id):  # never served here: a plain add
            return await self.add_lora(lora_request)
        lora_request = await local_adapter(lora_request, self.engine.model_config.model)
        replaced = await self.engine.replace_lora(old_lora_id, lora_request)
        return self.replica_id, replaced, await self.engine.lora_digest(lora_request.lora_id)

    async def remove_lora(self, lora_id: int) -> tuple[str, bool]:
        if not self.engine.engine.is_lora_registered(lora_id):
            return self.replica_id, False
        return self.replica_id, await self.engine.remove_lora(lora_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        """For the router: adapter versions held (slot or host; those with requests inside count as
        slot), keyed as the router's model ids are (`LoRARequest.version_key`)."""
        residency = self.engine.lora_version_residency()
        for name in self._in_flight:
            if name:
                residency[name] = "slot"
        return {
            "time": time.time(),
            "residency": residency,
            "num_in_flight": sum(self._in_flight.values()),
        }

    async def stats(self) -> dict[str, Any]:
        """The engine's stats for the ingress's /metrics; its lists (observations new since the last
        call, e.g. adapter load latencies) are drained, so one scraper, the ingress, should ask."""
        return self.engine.stats()

    async def check_health(self) -> None:
        if not self.engine.is_healthy():
            raise RuntimeError(f"replica {self.replica_id}: the engine is dead ({self.engine.dead_error})")
