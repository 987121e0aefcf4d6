"""`ReplicaClient`: the `EngineClient` of the HTTP app when the engines are Ray Serve replicas.

The ingress keeps everything the single-process server does (validation, tokenization, chat
templates, the adapter names and ids, resolvers, errors); only engine calls cross to a replica,
routed by adapter (`router.py`) through the deployment handle, with the adapter's version key
(`LoRARequest.version_key`, "name@<12 digest digits>") as the multiplexed model id: the router ranks
replicas by what they hold of that version, never of another version of the name. Every request
carries the digest the ingress resolved (`LoRARequest.version`), so a replica whose copy of the
adapter holds other content refuses it (404) rather than serve other weights. The digests the
ingress knows are those its loads (on one replica) reported.

Failures stay OpenAI-shaped: an error raised in a replica is re-raised here as itself (so it maps to
the same status as in one process); a replica that dies fails its requests with
`ReplicaUnavailableError` (503, Retry-After), except that a request which had produced nothing yet
is sent once more, to another replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import RequestCancelledError

from loraserve import envs
from loraserve.beam_search import BeamSearchParams
from loraserve.engine.fair_admission import AdmissionHold, ClientLimits, unlimited_hold
from loraserve.entrypoints.ray.deployment import ReplicaHello, ReplicaInfo
from loraserve.entrypoints.ray.known_replicas import known_replica_ids, note_loaded
from loraserve.entrypoints.ray.replica_header import note_replica
from loraserve.entrypoints.ray.router import TARGET_PREFIX
from loraserve.errors import EngineShutdownError, LoRAAdapterNotFoundError, ReplicaUnavailableError
from loraserve.lora.request import LoRARequest, version_key
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

logger = logging.getLogger("loraserve.server")
_REPLICA_LOST = (RayActorError, ActorUnavailableError)


def _unwrapped(exc: BaseException) -> BaseException:
    """The replica's own exception for a RayTaskError (its text is the bare message, no traceback)."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def _lost(replica_id: str | None, exc: BaseException) -> ReplicaUnavailableError:
    where = f"replica {replica_id}" if replica_id else "the replica chosen for it"
    return ReplicaUnavailableError(
        f"The request failed because {where} died or could not be reached ({type(exc).__name__}); "
        "a replacement is starting. Send the request again."
    )


class ReplicaClient:
    def __init__(self, handle: Any, info: ReplicaInfo) -> None:
        self._handle = handle
        self.model_config = info.model_config
        self.lora_config = info.lora_config
        self.scheduler_config = info.scheduler_config
        self.tokenizer = info.tokenizer
        self.dead_error: BaseException | None = None
        self._closed = False
        self._streams: dict[str, Any] = {}  # request id -> its DeploymentResponseGenerator
        self._background: set[asyncio.Task[bool]] = set()
        self._digests: dict[int, str] = {}  # lora id -> the content digest the loading replica reported
        self.stats_timeout_s = envs.replica_stats_timeout()

    @classmethod
    async def connect(cls, handle: Any) -> ReplicaClient:
        return cls(handle, await cls._call(handle.info.remote()))

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def is_healthy(self) -> bool:
        return not self._closed

    async def shutdown(self) -> None:
        """Requests still running end with EngineShutdownError (503); later calls are refused."""
        self._closed = True
        for stream in list(self._streams.values()):
            stream.cancel()

    async def generate(
        self,
        prompt: list[int] | dict[str, Any],
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        group_id: str | None = None,
        priority: int = 0,
        client_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        model_id = lora_request.version_key if lora_request is not None else ""
        for attempt in range(2):
            self._check_open()
            handle = self._handle.options(stream=True, multiplexed_model_id=model_id)
            stream = handle.generate.remote(
                prompt, sampling_params, request_id, lora_request, group_id, priority, client_id
            )
            self._streams[request_id] = stream
            replica_id: str | None = None
            has_output = finished = False
            try:
                async for item in stream:
                    if isinstance(item, ReplicaHello):
                        replica_id = item.replica_id
                        note_replica(replica_id)
                        continue
                    has_output, finished = True, item.finished
                    yield item
                return
            except _REPLICA_LOST as exc:
                if has_output or attempt > 0 or self._closed:
                    raise _lost(replica_id, exc) from None
                logger.warning(
                    "Replica %s was lost before request %s started; sending it again.",
                    replica_id or "(unknown)",
                    request_id,
                )
            except RequestCancelledError:
                if self._closed:
                    raise EngineShutdownError(
                        "The server is shutting down; the request did not finish."
                    ) from None
                raise
            except RayTaskError as exc:
                raise _unwrapped(exc) from None
            finally:
                self._streams.pop(request_id, None)
                if not finished:  # the consumer stopped early, or it failed: the replica aborts it
                    stream.cancel()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def admit(
        self,
        num_seqs: int,
        num_prefill_tokens: int,
        client_id: str | None = None,
        limits: ClientLimits | None = None,
    ) -> AdmissionHold:
        """Each replica's engine checks every request it is given (the per-request share included);
        a call of more than one sequence asks the least loaded replica first (advisory: its prompts
        go where the router sends them). That replica served nothing, so it is not in the replica
        header. Per-key shares and the wait for room are one engine's (`FairAdmission`): across
        replicas there is no one queue."""
        self._check_open()
        if num_seqs > 1:
            await self._call(self._handle.check_admission.remote(num_seqs, num_prefill_tokens))
        return unlimited_hold()

    async def check_admission(self, num_seqs: int, num_prefill_tokens: int) -> None:
        """Asks the least loaded replica: the prompts of one call then go where the router sends them
        (their adapter's replica), so across replicas this check is advisory."""
        self._check_open()
        note_replica(await self._call(self._handle.check_admission.remote(num_seqs, num_prefill_tokens)))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Validated (and loaded) on the replica that its requests will go to."""
        self._check_open()
        handle = self._handle.options(multiplexed_model_id=lora_request.version_key)
        replica_id, added, digest = await self._call(handle.add_lora.remote(lora_request))
        note_replica(replica_id)
        note_loaded(version_key(lora_request.lora_name, digest), replica_id)
        self._digests[lora_request.lora_id] = digest
        return bool(added)

    async def lora_digest(self, lora_id: int) -> str:
        """The digest the replica that loaded `lora_id` reported (`add_lora`)."""
        digest = self._digests.get(lora_id)
        if digest is None:
            raise LoRAAdapterNotFoundError(f"LoRA id {lora_id} was not loaded through this ingress.")
        return digest

    async def replace_lora(self, old_lora_id: int, lora_request: LoRARequest) -> bool:
        """The adapter's replica swaps it in place; the others drop the old id once its requests end
        (in the background) and read the new one when a request first needs it."""
        self._check_open()
        handle = self._handle.options(multiplexed_model_id=lora_request.version_key)
        replica_id, replaced, digest = await self._call(handle.replace_lora.remote(old_lora_id, lora_request))
        note_replica(replica_id)
        note_loaded(version_key(lora_request.lora_name, digest), replica_id)
        self._digests[lora_request.lora_id] = digest
        others = known_replica_ids() - {replica_id}
        task = asyncio.get_running_loop().create_task(self._remove_on(others, old_lora_id))
        self._background.add(task)  # referenced until done, or the loop may drop it
        task.add_done_callback(self._background.discard)
        return bool(replaced)

    async def remove_lora(self, lora_id: int) -> bool:
        """Removed from every replica; returns once its running requests have finished everywhere."""
        self._check_open()
        removed = await self._remove_on(known_replica_ids(), lora_id)
        self._digests.pop(lora_id, None)
        return removed

    async def _remove_on(self, replica_ids: set[str], lora_id: int) -> bool:
        calls = [
            self._call(
                self._handle.options(multiplexed_model_id=TARGET_PREFIX + rid).remove_lora.remote(lora_id)
            )
            for rid in sorted(replica_ids)
        ]
        removed = False
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, ReplicaUnavailableError):  # a dead replica holds nothing any more
                continue
            if isinstance(result, BaseException):
                raise result
            removed = removed or bool(result[1])
        return removed

    def stats(self) -> dict[str, Any]:
        """The ingress has no engine of its own: its stats are the replica count (see `replica_stats`)."""
        return {"num_replicas": len(known_replica_ids())}

    async def replica_stats(self) -> dict[str, dict[str, Any] | None]:
        """Every replica's engine stats, asked of all at once; None for one that does not answer within
        `stats_timeout_s` (its call is cancelled), so a dead or stuck replica never holds up /metrics."""
        replica_ids = sorted(known_replica_ids())
        results = await asyncio.gather(*(self._stats_of(rid) for rid in replica_ids))
        return dict(zip(replica_ids, results))

    async def _stats_of(self, replica_id: str) -> dict[str, Any] | None:
        response = self._handle.options(multiplexed_model_id=TARGET_PREFIX + replica_id).stats.remote()
        try:
            return dict(await asyncio.wait_for(self._call(response), self.stats_timeout_s))
        except Exception as exc:  # TimeoutError, a lost replica, or its own failure: skipped this scrape
            response.cancel()
            logger.warning(
                "Replica %s gave no engine stats for /metrics (%s); left out of this scrape.",
                replica_id,
                type(exc).__name__,
            )
            return None
        except asyncio.CancelledError:  # the scrape itself went away
            response.cancel()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise EngineShutdownError("The server is shutting down and accepts no new requests.")

    @staticmethod
    async def _call(response: Any) -> Any:
        try:
            return await response
        except _REPLICA_LOST as exc:
            raise _lost(None, exc) from None
        except RayTaskError as exc:
            raise _unwrapped(exc) from None
