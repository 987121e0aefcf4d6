"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.chat_roles import allowed_roles, check_roles, templates_of
from loraserve.entrypoints.openai.engine_client import EngineClient
from loraserve.entrypoints.openai.errors import APIError
from loraserve.entrypoints.openai.logprobs import chat_logprobs
from loraserve.entrypoints.openai.metrics import ServerMetrics
from loraserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from loraserve.entrypoints.openai.serving_engine import EnginePrompt, OpenAIServing
from loraserve.entrypoints.openai.serving_models import OpenAIServingModels
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class _ChatJob:
    request_id: str
    model_name: str
    prompt: EnginePrompt
    lora_request: LoRARequest | None
    num_top_logprobs: int | None
    render_token: Callable[[int, Logprob | None], str]
    sent_chars: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: EngineClient,
        models: OpenAIServingModels,
        metrics: ServerMetrics | None = None,
        trust_request_chat_template: bool = False,
        tokenizer_pool: Executor | None = None,
        response_role: str = "assistant",  # --response-role
        return_tokens_as_token_ids: bool = False,
    ) -> None:
        super().__init__(engine, models, metrics, tokenizer_pool, return_tokens_as_token_ids)
        self.trust_request_chat_template = trust_request_chat_template
        self.response_role = response_role

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=true) an iterator of SSE lines whose first item waits for output."""
        job = await self._prepare(request)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(job, include_usage)
        return await self._collect(job)

    async def _prepare(self, request: ChatCompletionRequest) -> _ChatJob:
        self.check_request(request)
        if request.tools:
            raise APIError("tools are not supported by this server.", HTTPStatus.BAD_REQUEST, "tools")
        model_name, lora_request = await self.resolve_model(request)
        text = await self.in_tokenizer_thread(self._render, request)
        prompt_ids = await self.encode(text, add_special_tokens=False, param="messages")
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = self.max_tokens_for(len(prompt_ids), requested, "messages")
        num_top = None
        if request.logprobs:
            num_top = request.top_logprobs or 0
        elif request.top_logprobs:
            raise APIError(
                "top_logprobs requires logprobs to be true.", HTTPStatus.BAD_REQUEST, "top_logprobs"
            )
        params = self.sampling_params(request, max_tokens, num_top)
        request_id = random_id("chatcmpl")
        prompt = EnginePrompt(request_id, prompt_ids, params)
        self.check_request_size([prompt])
        return _ChatJob(request_id, model_name, prompt, lora_request, num_top, self.token_renderer(request))

    def _render(self, request: ChatCompletionRequest) -> str:
        """The prompt text from the tokenizer's chat template; 400 for messages the template refuses.
        Runs on the tokenizer thread: a template is a program whose cost grows with the messages."""
        kwargs = dict(request.chat_template_kwargs or {})
        if request.chat_template is not None:
            kwargs["chat_template"] = request.chat_template
        # A template is code run on the server (loops, allocations): only the operator may allow it.
        if "chat_template" in kwargs and not self.trust_request_chat_template:
            raise APIError(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                HTTPStatus.BAD_REQUEST,
                "chat_template",
            )
        if not kwargs.get("chat_template") and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                "The model's tokenizer has no chat template, so chat completions are unavailable; "
                "use /v1/completions.",
                HTTPStatus.BAD_REQUEST,
                "messages",
            )
        # A role is printed into the prompt: only known roles, never template control text.
        own = getattr(self.tokenizer, "chat_template", None)
        templates = [*templates_of(kwargs.get("chat_template")), *templates_of(own)]
        check_roles([m.role for m in request.messages], allowed_roles(templates))
        messages = [
            {"role": m.role, "content": self._text(m.content, i)} for i, m in enumerate(request.messages)
        ]
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                **kwargs,
            )
        except Exception as exc:  # jinja2 errors (raise_exception in templates) and bad kwargs
            raise APIError(
                f"The chat template rejected the messages: {exc}", HTTPStatus.BAD_REQUEST, "messages"
            ) from exc
        return str(rendered)

    @staticmethod
    def _text(content: str | list[dict[str, Any]] | None, index: int) -> str:
        if content is None or isinstance(content, str):
            return content or ""
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    f"messages[{index}].content: only text parts are supported, got type {part.get('type')!r}.",
                    HTTPStatus.BAD_REQUEST,
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)

    def _logprobs(self, job: _ChatJob, seq: CompletionOutput, start: int) -> Any:
        if job.num_top_logprobs is None or seq.logprobs is None:
            return None
        return chat_logprobs(
            seq.token_ids[start:], list(seq.logprobs[start:]), job.num_top_logprobs, job.render_token
        )

    def _usage(self, job: _ChatJob, final: RequestOutput | None) -> UsageInfo:
        prompt_tokens = len(job.prompt.prompt_ids)
        completion_tokens = sum(len(seq.token_ids) for seq in final.outputs) if final is not None else 0
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    async def _collect(self, job: _ChatJob) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async with aclosing(self.generate([job.prompt], job.lora_request, job.model_name)) as outputs:
            async for _, output in outputs:
                final = output
        assert final is not None, "the engine finished a request without any output"
        choices = [
            ChatCompletionChoice(
                index=seq.index,
                message=ChatResponseMessage(role=self.response_role, content=seq.text),
                logprobs=self._logprobs(job, seq, 0),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(final.outputs, key=lambda s: s.index)
        ]
        return ChatCompletionResponse(
            id=job.request_id, model=job.model_name, choices=choices, usage=self._usage(job, final)
        )

    def _chunk(self, job: _ChatJob, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(id=job.request_id, model=job.model_name, choices=choices, usage=usage)
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    def _delta(self, job: _ChatJob, seq: CompletionOutput) -> ChatStreamChoice | None:
        """What `seq` adds since the last chunk; None when nothing new."""
        sent_tokens = job.sent_tokens.get(seq.index, 0)
        if seq.index in job.finished or (len(seq.token_ids) == sent_tokens and not seq.finished()):
            return None
        sent_chars = job.sent_chars.get(seq.index, 0)
        choice = ChatStreamChoice(
            index=seq.index,
            delta=DeltaMessage(content=seq.text[sent_chars:]),
            logprobs=self._logprobs(job, seq, sent_tokens),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        job.sent_chars[seq.index], job.sent_tokens[seq.index] = len(seq.text), len(seq.token_ids)
        if seq.finished():
            job.finished.add(seq.index)
        return choice

    async def _stream(self, job: _ChatJob, include_usage: bool) -> AsyncIterator[str]:
        final: RequestOutput | None = None
        async with aclosing(self.generate([job.prompt], job.lora_request, job.model_name)) as outputs:
            async for _, output in outputs:
                if final is None:
                    # The role chunk waits for the first output so that early engine errors get a status.
                    roles = [
                        ChatStreamChoice(index=i, delta=DeltaMessage(role=self.response_role, content=""))
                        for i in range(job.prompt.sampling_params.n)
                    ]
                    yield self._chunk(job, roles)
                final = output
                choices = [c for seq in output.outputs if (c := self._delta(job, seq)) is not None]
                if choices:
                    yield self._chunk(job, choices)
        if include_usage:
            yield self._chunk(job, [], usage=self._usage(job, final))
        yield "data: [DONE]\n\n"
