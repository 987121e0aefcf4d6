"""EngineClient: the engine as the serving layer uses it, and nothing more.

`AsyncLLMEngine` satisfies it, and so does the fake engine of the server tests; the routes and
handlers reach the engine only through these members.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from loraserve.beam_search import BeamSearchParams
    from loraserve.config import LoRAConfig, SchedulerConfig
    from loraserve.engine.fair_admission import AdmissionHold, ClientLimits
    from loraserve.lora.request import LoRARequest
    from loraserve.outputs import RequestOutput
    from loraserve.sampling_params import SamplingParams


class ServedModelConfig(Protocol):
    """The parts of `ModelConfig` the serving layer reads."""

    @property
    def model(self) -> str: ...  # as the user named it: the default served name and the resolvers' base

    @property
    def served_model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def sampling_defaults(self) -> Mapping[str, Any]: ...  # for fields a request leaves unset

    @property
    def vocab_size(self) -> int: ...


@runtime_checkable
class EngineClient(Protocol):
    @property
    def model_config(self) -> ServedModelConfig: ...

    @property
    def lora_config(self) -> LoRAConfig | None: ...  # None: LoRA is off

    @property
    def scheduler_config(self) -> SchedulerConfig: ...  # the queue limits a request is checked against

    @property
    def tokenizer(self) -> Any: ...

    @property
    def errored(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    def is_healthy(self) -> bool: ...

    async def shutdown(self) -> None:
        """Stop the engine; requests still running fail with EngineShutdownError (HTTP 503)."""
        ...

    def generate(
        self,
        prompt: list[int] | dict[str, Any],
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        group_id: str | None = None,
        priority: int = 0,
        client_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes; closing the iterator aborts it.
        Requests sharing a `group_id` (the prompts of one API call) take scheduling turns as one;
        `priority` orders them under scheduling_policy "priority". `prompt` may be a dict
        {"prompt_token_ids": ids, "cache_salt": salt} (vLLM's per-request prefix-cache salt).
        `client_id`: whose turn and share the request's work off the step loop (a new grammar's
        compile) counts in."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_admission(self, num_seqs: int, num_prefill_tokens: int) -> None:
        """EngineOverloadedError (503) unless a request of this size fits the queue now."""
        ...

    async def admit(
        self,
        num_seqs: int,
        num_prefill_tokens: int,
        client_id: str | None = None,
        limits: ClientLimits | None = None,
    ) -> AdmissionHold:
        """Room for one API call (all its prompts x n), held until the hold is released; waits a
        bounded time in turn by client (`client_id`: the API key's, None: a client of its own; `limits`:
        that key's own), then EngineOverloadedError (503); RequestTooLargeError (400) beyond one
        request's share."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool:
        """Unregister an adapter; returns once its running requests have finished."""
        ...

    async def replace_lora(self, old_lora_id: int, lora_request: LoRARequest) -> bool:
        """load_inplace: `lora_request` (a new id) replaces `old_lora_id` for new requests at once;
        running ones finish on the old weights."""
        ...

    async def lora_digest(self, lora_id: int) -> str:
        """The content digest (sha256 hex) of a registered adapter: its version, what `name@digest`
        addresses; LoRAAdapterNotFoundError when it is not registered."""
        ...

    def stats(self) -> dict[str, Any]:
        """A snapshot for /metrics: numbers, {adapter: count} maps, lists of new observations."""
        ...


@runtime_checkable
class ReplicaStatsSource(Protocol):
    """What an `EngineClient` in front of several engines (`--replicas`) adds: /metrics exports theirs."""

    async def replica_stats(self) -> dict[str, dict[str, Any] | None]:
        """Replica id -> that engine's `stats()`, or None when it did not answer within a bounded
        time (a dead or stuck replica never holds up a scrape)."""
        ...
