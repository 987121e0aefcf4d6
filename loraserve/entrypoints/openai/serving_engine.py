"""OpenAIServing: what completions and chat share between a parsed request and the engine's outputs.

It tokenizes and checks prompts against max_model_len, builds SamplingParams, routes `model` to the base
model or an adapter, runs one engine request per prompt and records metrics. Every engine request that
has not finished when its consumer stops (client gone, error elsewhere) is aborted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from loraserve.engine.admission import check_request_size
from loraserve.entrypoints.openai.engine_client import EngineClient
from loraserve.entrypoints.openai.errors import APIError, api_error_from_exception
from loraserve.entrypoints.openai.metrics import ServerMetrics
from loraserve.entrypoints.openai.protocol import SamplingRequest
from loraserve.entrypoints.openai.serving_models import OpenAIServingModels
from loraserve.entrypoints.openai.streams import merge_async_iterators
from loraserve.entrypoints.openai.structured_request import structured_outputs_of
from loraserve.entrypoints.openai.vllm_extras import refuse_unsupported_extras
from loraserve.errors import EngineDeadError
from loraserve.lora.request import LoRARequest
from loraserve.outputs import Logprob, RequestOutput
from loraserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams


@dataclass(slots=True)
class _Timing:
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0


class OpenAIServing:
    """Shared machinery of the generation endpoints."""

    def __init__(
        self,
        engine: EngineClient,
        models: OpenAIServingModels,
        metrics: ServerMetrics | None = None,
        tokenizer_pool: Executor | None = None,
        return_tokens_as_token_ids: bool = False,  # --return-tokens-as-token-ids: every request's default
    ) -> None:
        self.engine = engine
        self.models = models
        self.metrics = metrics
        # Tokenizing and rendering chat templates take CPU time that grows with the input; they run on
        # this one worker thread (shared by the endpoints, so the tokenizer is never used by two of them
        # at once), never on the event loop that serves every other connection.
        self.tokenizer_pool = tokenizer_pool or ThreadPoolExecutor(1, thread_name_prefix="loraserve-tokenizer")
        self._max_prompt_chars: int | None = None
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
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
        lora_request = await self.models.resolve_model(request.model)
        name = request.model if request.model is not None else self.models.served_model_name
        return name, lora_request

    def check_request(self, request: SamplingRequest) -> None:
        if request.logit_bias:
            raise APIError(
                "logit_bias is not supported by this server.", HTTPStatus.BAD_REQUEST, "logit_bias"
            )
        # vLLM's extras that would change the result are refused by name; other unknown fields are ignored.
        refuse_unsupported_extras(request.model_extra or {}, is_chat=hasattr(request, "messages"))
        if request.unknown_fields():
            logger.debug("Ignoring unknown request fields: %s", request.unknown_fields())

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the tokenizer worker thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_pool, functools.partial(fn, *args, **kwargs)
        )

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
        if len(text) > self.max_prompt_chars:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} "
                f"has {len(text)} characters, more than that many tokens can hold. Please reduce the length "
                "of the input.",
                HTTPStatus.BAD_REQUEST,
                param,
            )
        ids = await self.in_tokenizer_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit in max_model_len tokens, so it is refused untokenized.

        No token covers more characters than the longest vocabulary entry (byte-level BPE and
        SentencePiece entries are at least as long as the text they match); 4x more allows for
        normalizers that drop or merge characters.
        """
        if self._max_prompt_chars is None:
            try:
                longest = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
            except (AttributeError, NotImplementedError, TypeError):
                longest = 64
            self._max_prompt_chars = self.max_model_len * max(longest, 1) * 4
        return self._max_prompt_chars

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

    def sampling_params(
        self, request: SamplingRequest, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        """SamplingParams from the request (unset fields: the generation config's defaults, else vLLM's);
        its ValueErrors (which name the field) become 400s."""
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
            logprobs=logprobs,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured_outputs=structured_outputs_of(request),
        )
        if request.stop_token_ids:
            self.check_token_ids(request.stop_token_ids, "stop_token_ids")
        return SamplingParams(**values)

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
        if len(prompts) > 1:  # all or none: no prompt runs when a later one would find the queue full
            await self.engine.check_admission(
                sum(p.sampling_params.n for p in prompts),
                sum(p.sampling_params.n * len(p.prompt_ids) for p in prompts),
            )
        timings = [_Timing(time.perf_counter()) for _ in prompts]
        unfinished = {prompt.request_id: i for i, prompt in enumerate(prompts)}
        iterators = [
            self.engine.generate(
                p.prompt_ids, p.sampling_params, p.request_id, lora_request=lora_request, group_id=group_id
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
            else:
                self.metrics.inter_token_latency.labels(model_name).observe(now - timing.last_token_time)
            timing.last_token_time = now
            timing.num_tokens = num_tokens
        if output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else None
            self.metrics.requests.labels(model_name, reason or "unknown").inc()
            self.metrics.prompt_tokens.labels(model_name).inc(len(prompt.prompt_ids))
            self.metrics.generation_tokens.labels(model_name).inc(num_tokens)

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
