"""POST /v1/completions: text or token-id prompts (one or many), n choices each, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus

from loraserve.engine.admission import check_request_size
from loraserve.entrypoints.openai.errors import APIError
from loraserve.entrypoints.openai.logprobs import completion_logprobs
from loraserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from loraserve.entrypoints.openai.serving_engine import EnginePrompt, OpenAIServing
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class _ChoiceState:
    """How much of one choice a stream has already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass(slots=True)
class _Job:
    request_id: str
    model_name: str
    prompts: list[EnginePrompt]
    lora_request: LoRARequest | None
    num_top_logprobs: int | None
    render_token: Callable[[int, Logprob | None], str]
    states: dict[int, _ChoiceState] = field(default_factory=dict)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=true) an iterator of SSE lines whose first item waits for output."""
        job = await self._prepare(request)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(job, request.n, include_usage)
        return await self._collect(job, request.n)

    async def _prepare(self, request: CompletionRequest) -> _Job:
        self.check_request(request)
        if request.echo:
            raise APIError("echo is not supported by this server.", HTTPStatus.BAD_REQUEST, "echo")
        if request.suffix:
            raise APIError("suffix is not supported by this server.", HTTPStatus.BAD_REQUEST, "suffix")
        model_name, lora_request = await self.resolve_model(request)
        request_id = random_id("cmpl")
        prompts = []
        for i, prompt_ids in enumerate(await self._prompt_ids(request)):
            max_tokens = self.max_tokens_for(len(prompt_ids), request.max_tokens, "prompt")
            params = self.sampling_params(request, max_tokens, request.logprobs)
            prompts.append(EnginePrompt(f"{request_id}-{i}", prompt_ids, params))
        self.check_request_size(prompts)
        return _Job(
            request_id, model_name, prompts, lora_request, request.logprobs, self.token_renderer(request)
        )

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
        self, job: _Job, prompt_index: int, n: int, seq: CompletionOutput, start: _ChoiceState
    ) -> CompletionChoice:
        """The part of `seq` after `start` (all of it for a full response) as a choice."""
        logprobs = None
        if job.num_top_logprobs is not None and seq.logprobs is not None:
            logprobs = completion_logprobs(
                seq.token_ids[start.num_tokens :],
                list(seq.logprobs[start.num_tokens :]),
                job.num_top_logprobs,
                job.render_token,
                start.num_chars,
            )
        return CompletionChoice(
            index=prompt_index * n + seq.index,
            text=seq.text[start.num_chars :],
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    async def _collect(self, job: _Job, n: int) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self.generate(job.prompts, job.lora_request, job.model_name, job.request_id)) as outputs:
            async for index, output in outputs:
                finals[index] = output
        choices = [
            self._choice(job, index, n, seq, _ChoiceState())
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
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    async def _stream(self, job: _Job, n: int, include_usage: bool) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self.generate(job.prompts, job.lora_request, job.model_name, job.request_id)) as outputs:
            async for index, output in outputs:
                finals[index] = output
                choices = []
                for seq in output.outputs:
                    state = job.states.setdefault(index * n + seq.index, _ChoiceState())
                    if state.finished or (len(seq.token_ids) == state.num_tokens and not seq.finished()):
                        continue
                    choices.append(self._choice(job, index, n, seq, state))
                    state.num_chars, state.num_tokens = len(seq.text), len(seq.token_ids)
                    state.finished = seq.finished()
                if choices:
                    chunk = CompletionResponse(id=job.request_id, model=job.model_name, choices=choices)
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        if include_usage:
            chunk = CompletionResponse(
                id=job.request_id, model=job.model_name, choices=[], usage=self._usage(job, finals)
            )
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"
