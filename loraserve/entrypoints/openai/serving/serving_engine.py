"""OpenAIServing: what completions and chat share between a parsed request and its engine requests.

It tokenizes and checks prompts against max_model_len (a long text first in bounded pieces, so one
that cannot fit is refused without tokenizing it all), builds SamplingParams, routes `model` to the
base model or an adapter, and checks the request's size. Running the prompts on the engine
(admission, one engine request per prompt, metrics, aborts) is the `EngineRequestRunner` it holds
(`engine_requests`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus
from typing import Any, TypeVar

from loraserve.beam_search import BeamSearchParams
from loraserve.engine.admission import check_request_size
from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.serving.adapter_selection import select_adapter
from loraserve.entrypoints.openai.serving.beam_request import beam_search_params, check_beam_fields
from loraserve.entrypoints.openai.serving.client_identity import current_client
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.entrypoints.openai.serving.engine_requests import EnginePrompt, EngineRequestRunner
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.prompt_length import PromptLengthGuard
from loraserve.entrypoints.openai.serving.protocol import SamplingRequest
from loraserve.entrypoints.openai.serving.serving_models import OpenAIServingModels
from loraserve.entrypoints.openai.serving.structured_request import structured_outputs_of
from loraserve.entrypoints.openai.serving.tokenizer_pool import FairTokenizerPool
from loraserve.entrypoints.openai.serving.vllm_extras import refuse_unsupported_extras
from loraserve.entrypoints.openai.serving.vllm_fields import check_vllm_fields, logprob_count
from loraserve.errors import EngineDeadError
from loraserve.lora.request import LoRARequest
from loraserve.outputs import Logprob, RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.sampling_tokens import check_bad_words, tokenize_bad_words

__all__ = ["EnginePrompt", "OpenAIServing", "clamped_logit_bias"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
        self.runner = EngineRequestRunner(engine, metrics)  # admission, engine requests, metrics

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
        ids = await self.in_tokenizer_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )
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
            temperature=(
                default.get("temperature", 1.0) if request.temperature is None else request.temperature
            ),
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

    def generate(
        self,
        prompts: list[EnginePrompt],
        lora_request: LoRARequest | None,
        model_name: str,
        group_id: str | None = None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, cumulative output) from one engine request per prompt, interleaved; with
        `group_id` the prompts take scheduling turns as one request (`EngineRequestRunner.generate`)."""
        # Metrics are labelled by a served name: a weighted `model` ("pirate=0.3", a mix) is the
        # client's text, which would give every weight its own series.
        if lora_request is not None and lora_request.is_mix:
            model_name = self.models.served_model_name
        elif lora_request is not None:
            model_name = lora_request.lora_name
        return self.runner.generate(prompts, lora_request, model_name, group_id)


def clamped_logit_bias(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's range for a bias, as vLLM applies it to API requests (the keys become ids later). NaN
    is kept, so that the engine's check refuses it naming the field: clamping it would make it -100."""
    if logit_bias is None:
        return None
    return {
        token: bias if math.isnan(bias) else min(100.0, max(-100.0, bias))
        for token, bias in logit_bias.items()
    }
