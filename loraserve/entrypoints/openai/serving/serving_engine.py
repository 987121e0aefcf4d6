"""OpenAIServing: what completions and chat share between a parsed request and the engine's outputs.

It tokenizes and checks prompts against max_model_len (a long text first in bounded pieces, so one
that cannot fit is refused without tokenizing it all), builds SamplingParams, routes `model` to the
base model or an adapter, is admitted to the engine's queue as one call (`EngineClient.admit`, by API
key), runs one engine request per prompt and records metrics. Every engine request that has not
finished when its consumer stops (client gone, error elsewhere) is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from loraserve.beam_search import BeamSearchParams
from loraserve.engine.admission import check_request_size
from loraserve.engine.fair_admission import AdmissionHold
from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.metrics.vllm_metrics import FinishedRequest
from loraserve.entrypoints.openai.serving.adapter_selection import select_adapter
from loraserve.entrypoints.openai.serving.beam_request import beam_search_params, check_beam_fields
from loraserve.entrypoints.openai.serving.client_identity import current_client
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.entrypoints.openai.serving.errors import APIError, api_error_from_exception
from loraserve.entrypoints.openai.serving.prompt_length import PromptLengthGuard
from loraserve.entrypoints.openai.serving.protocol import SamplingRequest
from loraserve.entrypoints.openai.serving.serving_models import OpenAIServingModels
from loraserve.entrypoints.openai.serving.streams import merge_async_iterators
from loraserve.entrypoints.openai.serving.structured_request import structured_outputs_of
from loraserve.entrypoints.openai.serving.tokenizer_pool import FairTokenizerPool
from loraserve.entrypoints.openai.serving.vllm_extras import refuse_unsupported_extras
from loraserve.entrypoints.openai.serving.vllm_fields import check_vllm_fields, logprob_count
from loraserve.errors import EngineDeadError
from loraserve.lora.request import LoRARequest
from loraserve.outputs import Logprob, RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.sampling_tokens import check_bad_words, tokenize_bad_words

logger = logging.getLogger(__name__)
T = TypeVar("T")


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


class OpenAIServing:
    """Shared machinery of the generation endpoints."""

    def __init__(
        self,
        engine: EngineClient,
        models: OpenAIServingModels,
        metrics: ServerMetrics | None = None,
        tokenizer_pool: FairTokenizerPool | None = None,
        return_tokens_as_token_ids: bool = False,  # --return-tokens-as-token-ids: every request's default
        enable_prompt_tokens_details: bool = False,  # usage.prompt_tokens_details.cached_tokens
    ) -> None:
        self.engine = engine
        self.models = models
        self.metrics = metrics
        # Tokenizing and rendering chat templates take CPU time that grows with the input; they run on
        # these workers (shared by the endpoints, in turn by client), never on the event loop that
        # serves every other connection.
        self.tokenizer_pool = tokenizer_pool or FairTokenizerPool()
        self._length_guard: PromptLengthGuard | None = None
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self._background: set[asyncio.Task] = set()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    async def resolve_model(self, request: SamplingRequest) -> tuple[str, LoRARequest | None]:
        """(name to report in responses, adapter or None); 404/400 APIError for unknown or broken names."""
        if self.engine.errored:
            raise EngineDeadError(str(self.engine.dead_error or "the engine loop stopped"))
        if request.model == "":  # vLLM serves the default model for an empty name
            request.model = None
        lora_request = await select_adapter(request, self.models)
        name = request.model if request.model is not None else self.models.served_model_name
        return name, lora_request

    def check_request(self, request: SamplingRequest) -> None:
        check_vllm_fields(request)
        check_beam_fields(request)
        policy = getattr(self.engine.scheduler_config, "scheduling_policy", "fcfs")
        if request.priority != 0 and policy != "priority":  # vLLM's text
            raise APIError(
                f"Got priority {request.priority} but Priority scheduling is not enabled.",
                HTTPStatus.BAD_REQUEST,
                "priority",
            )
        # vLLM's extras that would change the result are refused by name; other unknown fields are ignored.
        refuse_unsupported_extras(request.model_extra or {}, is_chat=hasattr(request, "messages"))
        if request.unknown_fields():
            logger.debug("Ignoring unknown request fields: %s", request.unknown_fields())

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on a tokenizer worker, in the turn of the request's client."""
        return await self.tokenizer_pool.run(current_client().fairness_key, fn, *args, **kwargs)

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of `text` (tokenized off the event loop); 400 for text that is not valid Unicode or
        is too long to fit in max_model_len whatever its tokens."""
        if self.tokenizer is None:
            raise APIError(
                "This server was started with --skip-tokenizer-init: it has no tokenizer, so the prompt must be "
                "token ids (a list of integers) and chat completions are unavailable.",
                HTTPStatus.BAD_REQUEST,
                param,
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates ("\ud800") are valid JSON but not text
            raise APIError(
                f"The {param} is not valid Unicode text: {exc.reason} at position {exc.start}.",
                HTTPStatus.BAD_REQUEST,
                param,
            ) from exc
        await self.length_guard.check(text, param, self.in_tokenizer_thread)
        ids = await self.in_tokenizer_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)

    @property
    def length_guard(self) -> PromptLengthGuard:
        """Built on first use: the tokenizer's vocabulary is read once."""
        if self._length_guard is None:
            self._length_guard = PromptLengthGuard(self.tokenizer, self.max_model_len)
        return self._length_guard

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.engine.model_config.vocab_size
        for token_id in token_ids:
            if token_id < 0 or token_id >= vocab_size:
                raise APIError(
                    f"Token id {token_id} is out of vocabulary (vocab_size={vocab_size}).",
                    HTTPStatus.BAD_REQUEST,
                    param,
                )

    def max_tokens_for(self, prompt_len: int, requested: int | None, param: str) -> int:
        """The completion budget: `requested`, or whatever max_model_len leaves; 400 when it cannot fit."""
        if prompt_len == 0:
            raise APIError(
                "The prompt is empty; it must contain at least one token.", HTTPStatus.BAD_REQUEST, param
            )
        if prompt_len >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                f"has {prompt_len} input tokens, which leaves no room for the completion. Please reduce "
                "the length of the input.",
                HTTPStatus.BAD_REQUEST,
                param,
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if requested >= 1 and prompt_len + requested > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the input, {requested} in the "
                "completion). Please reduce the length of the input or completion.",
                HTTPStatus.BAD_REQUEST,
                "max_tokens",
            )
        return requested

    async def bad_words_token_ids(self, request: SamplingRequest) -> list[list[int]] | None:
        """The request's bad_words as vLLM tokenizes them, once per request, on the tokenizer pool (None
        without a tokenizer: the engine's check then names the field)."""
        words = check_bad_words(request.bad_words)
        if not words or self.tokenizer is None:
            return None
        return await self.in_tokenizer_thread(tokenize_bad_words, words, self.tokenizer)

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """SamplingParams from the request (unset fields: the generation config's defaults, else vLLM's);
        its ValueErrors (which name the field) become 400s. BeamSearchParams with use_beam_search.
        `bad_words_token_ids`: from `bad_words_token_ids(request)`."""
        if request.stop_token_ids:
            self.check_token_ids(request.stop_token_ids, "stop_token_ids")
        if request.use_beam_search:
            return beam_search_params(request, max_tokens)
        default = self.engine.model_config.sampling_defaults
        values: dict[str, Any] = dict(
            n=request.n,
            temperature=default.get("temperature", 1.0) if request.temperature is None else request.temperature,
            top_p=default.get("top_p", 1.0) if request.top_p is None else request.top_p,
            top_k=default.get("top_k", -1) if request.top_k is None else request.top_k,
            min_p=default.get("min_p", 0.0) if request.min_p is None else request.min_p,
            repetition_penalty=(
                default.get("repetition_penalty", 1.0)
                if request.repetition_penalty is None
                else request.repetition_penalty
            ),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprob_count(logprobs, self.engine.model_config.vocab_size),
            prompt_logprobs=logprob_count(prompt_logprobs, self.engine.model_config.vocab_size),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured_outputs=structured_outputs_of(request),
            logit_bias=clamped_logit_bias(request.logit_bias),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
            bad_words_token_ids=bad_words_token_ids,
        )
        params = SamplingParams(**values)
        tokenizer_size = None if self.tokenizer is None else len(self.tokenizer)
        params.verify_token_ids(self.engine.model_config.vocab_size, tokenizer_size)  # before queueing
        return params

    def check_request_size(self, prompts: list[EnginePrompt]) -> None:
        """400 when the whole request (every prompt x n) exceeds what the engine ever queues at once."""
        num_seqs = sum(p.sampling_params.n for p in prompts)
        num_tokens = sum(p.sampling_params.n * len(p.prompt_ids) for p in prompts)
        check_request_size(self.engine.scheduler_config, num_seqs, num_tokens)

    def decode_token(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def token_renderer(self, request: SamplingRequest) -> Callable[[int, Logprob | None], str]:
        """How logprobs name tokens: their text, or "token_id:<id>" when the request asks for ids."""
        if request.return_tokens_as_token_ids or self.return_tokens_as_token_ids or self.tokenizer is None:
            return lambda token_id, _: f"token_id:{token_id}"
        return self.decode_token

    async def generate(
        self,
        prompts: list[EnginePrompt],
        lora_request: LoRARequest | None,
        model_name: str,
        group_id: str | None = None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, cumulative output) from one engine request per prompt, interleaved; with
        `group_id` the prompts take scheduling turns as one request."""
        arrival = time.perf_counter()  # time to first token counts the wait for admission too
        arrival_wall = time.time()  # and so do vLLM's phase times (wall clock)
        hold = await self.engine.admit(
            sum(p.sampling_params.n for p in prompts),
            sum(p.sampling_params.n * len(p.prompt_ids) for p in prompts),
            current_client().api_key,
        )  # all or none: no prompt starts unless the whole call has room
        # Metrics are labelled by a served name: a weighted `model` ("pirate=0.3", a mix) is the
        # client's text, which would give every weight its own series.
        if lora_request is not None and lora_request.is_mix:
            model_name = self.models.served_model_name
        elif lora_request is not None:
            model_name = lora_request.lora_name
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


def clamped_logit_bias(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's range for a bias, as vLLM applies it to API requests (the keys become ids later)."""
    if logit_bias is None:
        return None
    return {token: min(100.0, max(-100.0, bias)) for token, bias in logit_bias.items()}


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
