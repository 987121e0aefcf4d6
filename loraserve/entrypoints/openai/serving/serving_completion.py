"""POST /v1/completions: text or token-id prompts (one or many), n choices each, streamed or not.

A stream sends one choice per chunk (as OpenAI and vLLM do). `echo` puts the prompt before the
completion (its text and, with `logprobs`, its tokens' logprobs: the engine computes prompt logprobs
for it, never from the prefix cache), in the first chunk of each choice when streaming.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from http import HTTPStatus

from loraserve.engine.admission import check_request_size
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.logprobs import completion_logprobs
from loraserve.entrypoints.openai.serving.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from loraserve.entrypoints.openai.serving.serving_engine import EnginePrompt, OpenAIServing
from loraserve.entrypoints.openai.serving.vllm_fields import (
    engine_request_id,
    logprob_count,
    prompt_logprobs_json,
    response_id,
    truncate_prompt,
    usage,
)
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


@dataclass(slots=True)
class _ChoiceState:
    """How much of one choice a stream has already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False
    started: bool = False  # the first chunk (echoed prompt, prompt_token_ids) has been sent


@dataclass(slots=True)
class _Job:
    request_id: str
    model_name: str
    prompts: list[EnginePrompt]
    lora_request: LoRARequest | None
    num_top_logprobs: int | None
    render_token: Callable[[int, Logprob | None], str]
    request: CompletionRequest
    echo_texts: list[str] = field(default_factory=list)  # per prompt, when echo
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (vLLM generates one token, unsent)
    states: dict[int, _ChoiceState] = field(default_factory=dict)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=true) an iterator of SSE lines whose first item waits for output."""
        job = await self._prepare(request)
        if request.stream and not request.use_beam_search:  # vLLM answers beam search in one body
            return self._stream(job, request.n)
        return await self._collect(job, request.n)

    async def _prepare(self, request: CompletionRequest) -> _Job:
        self.check_request(request)
        if request.suffix:
            raise APIError("suffix is not supported by this server.", HTTPStatus.BAD_REQUEST, "suffix")
        model_name, lora_request = await self.resolve_model(request)
        request_id = response_id("cmpl", request)
        engine_id = engine_request_id(request_id, request)
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:  # vLLM: echo's prompt gets the requested logprobs
            prompt_logprobs = request.logprobs
        prompts = []
        bad_words = await self.bad_words_token_ids(request)
        for i, prompt_ids in enumerate(await self._prompt_ids(request)):
            prompt_ids = truncate_prompt(prompt_ids, request, self.max_model_len)
            echo_only = bool(request.echo) and request.max_tokens == 0
            requested = 1 if echo_only else request.max_tokens
            max_tokens = self.max_tokens_for(len(prompt_ids), requested, "prompt")
            params = self.sampling_params(request, max_tokens, request.logprobs, prompt_logprobs, bad_words)
            prompts.append(
                EnginePrompt(f"{engine_id}-{i}", prompt_ids, params, request.priority, request.cache_salt)
            )
        self.check_request_size(prompts)
        job = _Job(
            request_id,
            model_name,
            prompts,
            lora_request,
            logprob_count(request.logprobs, self.engine.model_config.vocab_size),
            self.token_renderer(request),
            request,
        )
        job.echo_only = bool(request.echo) and request.max_tokens == 0
        if request.echo:
            job.echo_texts = [
                await self._prompt_text(request, i, p.prompt_ids) for i, p in enumerate(prompts)
            ]
        return job

    async def _prompt_text(self, request: CompletionRequest, index: int, prompt_ids: list[int]) -> str:
        """What echo puts first: the prompt as sent, or its tokens' text (token ids, truncated prompts)."""
        prompt = request.prompt
        text = prompt if isinstance(prompt, str) else prompt[index] if isinstance(prompt[0], str) else None
        if isinstance(text, str) and request.truncate_prompt_tokens is None:
            return text
        if self.tokenizer is None:
            return ""
        return str(await self.in_tokenizer_thread(self.tokenizer.decode, prompt_ids))

    async def _prompt_ids(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return [await self.encode(prompt)]
        if not prompt:
            raise APIError("prompt must not be an empty list.", HTTPStatus.BAD_REQUEST, "prompt")
        batch: list = [prompt] if isinstance(prompt[0], int) else list(prompt)
        # Count first: a request of a million tiny prompts is refused before any work per prompt.
        check_request_size(self.engine.scheduler_config, len(batch) * request.n, 0)
        result = []
        for item in batch:
            ids = await self.encode(item) if isinstance(item, str) else list(item)
            self.max_tokens_for(len(ids), None, "prompt")  # its length before each of its ids
            self.check_token_ids(ids, "prompt")
            result.append(ids)
        return result

    def _choice(
        self,
        job: _Job,
        output: RequestOutput,
        prompt_index: int,
        n: int,
        seq: CompletionOutput,
        start: _ChoiceState,
    ) -> CompletionChoice:
        """The part of `seq` after `start` (all of it for a full response) as a choice; the first part
        of a choice carries the echoed prompt."""
        first = not start.started
        echo = bool(job.echo_texts) and first
        echo_text = job.echo_texts[prompt_index] if echo else ""
        logprobs = self._logprobs(job, output, prompt_index, seq, start, echo)
        with_ids = bool(job.request.return_token_ids)
        return CompletionChoice(
            index=prompt_index * n + seq.index,
            text=echo_text + seq.text[start.num_chars :],
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            prompt_logprobs=(
                prompt_logprobs_json(output.prompt_logprobs, job.render_token)
                if first and job.request.prompt_logprobs is not None
                else None
            ),
            prompt_token_ids=list(output.prompt_token_ids) if with_ids and first else None,
            token_ids=list(seq.token_ids[start.num_tokens :]) if with_ids else None,
        )

    @staticmethod
    def _logprobs(
        job: _Job,
        output: RequestOutput,
        prompt_index: int,
        seq: CompletionOutput,
        start: _ChoiceState,
        echo: bool,
    ) -> CompletionLogprobs | None:
        """The logprobs of `seq` after `start`; an echoed prompt's tokens first (the first None)."""
        if job.num_top_logprobs is None or (seq.logprobs is None and not echo):
            return None
        token_ids = seq.token_ids[start.num_tokens :]
        positions: list[PositionLogprobs | None] = [*(seq.logprobs or [])[start.num_tokens :]]
        offset = start.num_chars + (
            len(job.echo_texts[prompt_index]) if job.echo_texts and start.started else 0
        )
        if echo:
            num_prompt = len(output.prompt_token_ids)
            token_ids = [*output.prompt_token_ids, *token_ids]
            positions = [*(output.prompt_logprobs or [None] * num_prompt)[:num_prompt], *positions]
        return completion_logprobs(token_ids, positions, job.num_top_logprobs, job.render_token, offset)

    async def _collect(self, job: _Job, n: int) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(
            self.generate(job.prompts, job.lora_request, job.model_name, job.request_id)
        ) as outputs:
            async for index, output in outputs:
                output = _visible(job, output)
                finals[index] = output
        choices = [
            self._choice(job, finals[index], index, n, seq, _ChoiceState())
            for index in sorted(finals)
            for seq in finals[index].outputs
        ]
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=job.request_id, model=job.model_name, choices=choices, usage=self._usage(job, finals)
        )

    def _usage(self, job: _Job, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt_tokens = sum(len(prompt.prompt_ids) for prompt in job.prompts)
        completion_tokens = sum(len(seq.token_ids) for output in finals.values() for seq in output.outputs)
        cached = sum(output.num_cached_tokens or 0 for output in finals.values())
        return usage(prompt_tokens, completion_tokens, cached, self.enable_prompt_tokens_details)

    async def _stream(self, job: _Job, n: int) -> AsyncIterator[str]:
        options = job.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        finals: dict[int, RequestOutput] = {}
        async with aclosing(
            self.generate(job.prompts, job.lora_request, job.model_name, job.request_id)
        ) as outputs:
            async for index, output in outputs:
                output = _visible(job, output)
                finals[index] = output
                for seq in output.outputs:  # one choice per chunk, as OpenAI and vLLM send them
                    state = job.states.setdefault(index * n + seq.index, _ChoiceState())
                    if state.finished or (len(seq.token_ids) == state.num_tokens and not seq.finished()):
                        continue
                    choice = self._choice(job, output, index, n, seq, state)
                    state.num_chars, state.num_tokens = len(seq.text), len(seq.token_ids)
                    state.finished, state.started = seq.finished(), True
                    chunk = CompletionResponse(id=job.request_id, model=job.model_name, choices=[choice])
                    if continuous:
                        chunk.usage = usage(
                            len(job.prompts[index].prompt_ids), len(seq.token_ids), None, False
                        )
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        if include_usage:
            chunk = CompletionResponse(
                id=job.request_id, model=job.model_name, choices=[], usage=self._usage(job, finals)
            )
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"


def _visible(job: _Job, output: RequestOutput) -> RequestOutput:
    """What the response shows of `output`: for an echo of max_tokens 0, no generated token."""
    if not job.echo_only:
        return output
    hidden = [
        replace(seq, text="", token_ids=[], logprobs=[] if seq.logprobs is not None else None)
        for seq in output.outputs
    ]
    return replace(output, outputs=hidden)
