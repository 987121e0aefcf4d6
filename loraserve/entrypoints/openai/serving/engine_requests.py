"""EngineRequestRunner: one API call's prompts run as engine requests, from admission to the last output.

The whole call is admitted to the engine's queue at once (`EngineClient.admit`, by API key) and its
admission given back piece by piece (a prompt's tokens once prefilled, its sequences once finished);
one engine request runs per prompt and their outputs are interleaved; every output is recorded in the
server's metrics (time to first token, inter-token latency, vLLM's per-request histograms). Every
engine request that has not finished when its consumer stops (client gone, error elsewhere) is
aborted. `EnginePrompt` is what the endpoints hand it: one prompt, ready for the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from loraserve.beam_search import BeamSearchParams
from loraserve.engine.fair_admission import AdmissionHold
from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.metrics.vllm_metrics import FinishedRequest
from loraserve.entrypoints.openai.serving.client_identity import current_client
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.entrypoints.openai.serving.errors import APIError, api_error_from_exception
from loraserve.entrypoints.openai.serving.streams import merge_async_iterators
from loraserve.lora.request import LoRARequest
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams | BeamSearchParams  # BeamSearchParams: use_beam_search
    priority: int = 0  # vLLM's, with --scheduling-policy priority
    cache_salt: str | None = None  # vLLM's: this request's prefix-cache blocks are keyed by it too

    def engine_input(self) -> list[int] | dict[str, Any]:
        """The prompt as the engine takes it: a dict when it carries a cache salt (vLLM's form)."""
        if self.cache_salt is None:
            return self.prompt_ids
        return {"prompt_token_ids": self.prompt_ids, "cache_salt": self.cache_salt}


@dataclass(slots=True)
class _Timing:
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0
    arrival_wall: float = field(default_factory=time.time)  # vLLM's phase times are wall clock
    first_token_wall: float | None = None


class EngineRequestRunner:
    """Runs calls' prompts on the engine; holds the background aborts until they are done."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    async def generate(
        self,
        prompts: list[EnginePrompt],
        lora_request: LoRARequest | None,
        model_name: str,
        group_id: str | None = None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, cumulative output) from one engine request per prompt, interleaved; with
        `group_id` the prompts take scheduling turns as one request. `model_name` labels the metrics."""
        arrival = time.perf_counter()  # time to first token counts the wait for admission too
        arrival_wall = time.time()  # and so do vLLM's phase times (wall clock)
        client = current_client()
        hold = await self.engine.admit(
            sum(p.sampling_params.n for p in prompts),
            sum(p.sampling_params.n * len(p.prompt_ids) for p in prompts),
            client.api_key,
            client.scope.limits,  # the key's own limits (--api-key-file), beside its share
        )  # all or none: no prompt starts unless the whole call has room
        run = self._run(prompts, lora_request, model_name, group_id, hold, arrival, arrival_wall)
        async with hold, aclosing(run) as outputs:
            async for item in outputs:
                yield item

    async def _run(
        self,
        prompts: list[EnginePrompt],
        lora_request: LoRARequest | None,
        model_name: str,
        group_id: str | None,
        hold: AdmissionHold,
        arrival: float,
        arrival_wall: float,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        timings = [_Timing(arrival, arrival_wall=arrival_wall) for _ in prompts]
        unfinished = {prompt.request_id: i for i, prompt in enumerate(prompts)}
        unprefilled = set(range(len(prompts)))
        iterators = [
            self.engine.generate(
                p.engine_input(),
                p.sampling_params,
                p.request_id,
                lora_request=lora_request,
                group_id=group_id,
                priority=p.priority,
                client_id=current_client().fairness_key,
            )
            for p in prompts
        ]
        try:
            async with aclosing(merge_async_iterators(iterators)) as merged:
                async for index, output in merged:
                    if output.error:  # the adapter's fault (its 4xx), else the server's (500)
                        if output.error_cause is not None:
                            raise api_error_from_exception(output.error_cause)
                        raise APIError(output.error, HTTPStatus.INTERNAL_SERVER_ERROR)
                    self._record(timings[index], prompts[index], output, model_name)
                    _give_back(hold, prompts[index], output, index, unprefilled)
                    if output.finished:
                        unfinished.pop(prompts[index].request_id, None)
                    yield index, output
        finally:
            if unfinished:
                self._abort_in_background(list(unfinished), model_name)

    def _record(self, timing: _Timing, prompt: EnginePrompt, output: RequestOutput, model_name: str) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        num_tokens = sum(len(seq.token_ids) for seq in output.outputs)
        if num_tokens > timing.num_tokens:
            if timing.last_token_time is None:
                self.metrics.time_to_first_token.labels(model_name).observe(now - timing.arrival)
                self.metrics.vllm.observe_tokens(True, now - timing.arrival)
                timing.first_token_wall = time.time()
            else:
                self.metrics.inter_token_latency.labels(model_name).observe(now - timing.last_token_time)
                self.metrics.vllm.observe_tokens(False, now - timing.last_token_time)
            timing.last_token_time = now
            timing.num_tokens = num_tokens
        if output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else None
            self.metrics.requests.labels(model_name, reason or "unknown").inc()
            self.metrics.prompt_tokens.labels(model_name).inc(len(prompt.prompt_ids))
            self.metrics.generation_tokens.labels(model_name).inc(num_tokens)
            self.metrics.vllm.observe_finished(
                _finished(timing, prompt, output, reason or "unknown", num_tokens)
            )

    def _abort_in_background(self, request_ids: list[str], model_name: str) -> None:
        # The caller may be inside a cancelled scope where any await is cancelled again: abort in a task.
        if self.metrics is not None:
            self.metrics.requests.labels(model_name, "abort").inc(len(request_ids))

        async def abort_all() -> None:
            for request_id in request_ids:
                try:
                    await self.engine.abort(request_id)
                except Exception:
                    logger.exception("Aborting request %s failed.", request_id)

        task = asyncio.get_running_loop().create_task(abort_all())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _give_back(
    hold: AdmissionHold, prompt: EnginePrompt, output: RequestOutput, index: int, unprefilled: set[int]
) -> None:
    """Return a prompt's part of the admission: its tokens once every choice has one (prefilled), its
    sequences once it finished."""
    n = prompt.sampling_params.n
    tokens = n * len(prompt.prompt_ids)
    done_prefill = len(output.outputs) >= n and all(seq.token_ids for seq in output.outputs)
    if index in unprefilled and (done_prefill or output.finished):
        unprefilled.discard(index)
        hold.prefilled(tokens)
    if output.finished:
        hold.finished(n)


def _finished(
    timing: _Timing, prompt: EnginePrompt, output: RequestOutput, reason: str, num_tokens: int
) -> FinishedRequest:
    params = prompt.sampling_params
    return FinishedRequest(
        num_prompt_tokens=len(prompt.prompt_ids),
        num_generation_tokens=num_tokens,
        finish_reason=reason,
        n=params.n,
        max_tokens=params.max_tokens or 0,
        arrival=min(output.metrics.get("arrival_time", timing.arrival_wall), timing.arrival_wall),
        first_scheduled=output.metrics.get("first_scheduled_time"),
        first_token=timing.first_token_wall,
        finished=time.time(),
    )
