"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, streamed or not.

A stream sends one choice per chunk (as OpenAI and vLLM do), starting with each choice's role chunk.
Tools (`tool_request.py`) go to the template; the output is read for calls by the plan's parser
(`tool_output.py`), whole or streamed as deltas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from loraserve.beam_search import BeamSearchParams
from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.serving.beam_request import num_choices
from loraserve.entrypoints.openai.serving.chat_render import message_text, render_chat
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.logprobs import chat_logprobs
from loraserve.entrypoints.openai.serving.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from loraserve.entrypoints.openai.serving.serving_engine import EnginePrompt, OpenAIServing
from loraserve.entrypoints.openai.serving.serving_models import OpenAIServingModels
from loraserve.entrypoints.openai.serving.tokenizer_pool import FairTokenizerPool
from loraserve.entrypoints.openai.serving.tool_output import (
    delta_message,
    finish_reason,
    new_stream,
    response_message,
)
from loraserve.entrypoints.openai.serving.tool_request import (
    BEAM_WITH_FORCED_TOOLS,
    BOTH_CONSTRAINTS,
    NO_TOOLS,
    ToolPlan,
    ToolSettings,
    tool_plan,
)
from loraserve.entrypoints.openai.serving.vllm_fields import (
    engine_request_id,
    logprob_count,
    prompt_logprobs_json,
    response_id,
    truncate_prompt,
    usage,
)
from loraserve.entrypoints.openai.tool_parsers.streaming import ToolCallStream
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class ChatJob:
    """One chat request, rendered, tokenized and checked: what the engine runs (the Responses API
    prepares its requests through it too)."""

    request_id: str
    model_name: str
    prompt: EnginePrompt
    lora_request: LoRARequest | None
    num_top_logprobs: int | None
    render_token: Callable[[int, Logprob | None], str]
    request: ChatCompletionRequest
    tools: ToolPlan = NO_TOOLS
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)
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
        tokenizer_pool: FairTokenizerPool | None = None,
        response_role: str = "assistant",  # --response-role
        return_tokens_as_token_ids: bool = False,
        enable_prompt_tokens_details: bool = False,
        tool_settings: ToolSettings | None = None,  # --enable-auto-tool-choice, --tool-call-parser, ...
    ) -> None:
        super().__init__(
            engine, models, metrics, tokenizer_pool, return_tokens_as_token_ids, enable_prompt_tokens_details
        )
        self.trust_request_chat_template = trust_request_chat_template
        self.response_role = response_role
        self.tool_settings = tool_settings or ToolSettings()

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=true) an iterator of SSE lines whose first item waits for output."""
        job = await self.prepare(request)
        if request.stream:
            return self._stream(job)
        return await self._collect(job)

    async def prepare(self, request: ChatCompletionRequest, request_id: str | None = None) -> ChatJob:
        """The request checked, its model resolved, its messages rendered and tokenized, its tools
        planned and its sampling params built; `request_id` names it (default: vLLM's chatcmpl id)."""
        self.check_request(request)
        plan = tool_plan(request, self.tool_settings)
        model_name, lora_request = await self.resolve_model(request)
        text = await self.in_tokenizer_thread(self._render, request, plan.template_tools)
        prompt_ids = await self.encode(text, add_special_tokens=False, param="messages")
        prompt_ids = truncate_prompt(prompt_ids, request, self.max_model_len)
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = self.max_tokens_for(len(prompt_ids), requested, "messages")
        num_top = None
        if request.logprobs:  # -1: the whole vocabulary (then --max-logprobs applies, vLLM's text)
            num_top = logprob_count(request.top_logprobs or 0, self.engine.model_config.vocab_size)
        bad_words = await self.bad_words_token_ids(request)
        params = self.sampling_params(request, max_tokens, num_top, request.prompt_logprobs, bad_words)
        if plan.structured is not None:  # "required" / a named function: the grammar writes the calls
            # Beams take no grammar (structured outputs are a 400 too).
            if isinstance(params, BeamSearchParams):
                raise APIError(BEAM_WITH_FORCED_TOOLS, HTTPStatus.BAD_REQUEST, "tool_choice")
            if params.structured_outputs is not None:
                raise APIError(BOTH_CONSTRAINTS, HTTPStatus.BAD_REQUEST, "tool_choice")
            params.structured_outputs = plan.structured
        if not plan.skip_special_tokens:  # the parser's markers are special tokens (vLLM's adjust_request)
            if isinstance(params, BeamSearchParams):  # frozen
                params = dataclasses.replace(params, skip_special_tokens=False)
            else:
                params.skip_special_tokens = False
        request_id = request_id or response_id("chatcmpl", request)
        prompt = EnginePrompt(
            engine_request_id(request_id, request), prompt_ids, params, request.priority, request.cache_salt
        )
        self.check_request_size([prompt])
        return ChatJob(
            request_id, model_name, prompt, lora_request, num_top, self.token_renderer(request), request, plan
        )

    def _render(self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> str:
        return render_chat(self.tokenizer, request, tools, self.trust_request_chat_template)

    def _echo(self, job: ChatJob) -> str:
        """vLLM's chat `echo`: the last message's text when its role is the reply's, else ""."""
        last = job.request.messages[-1]
        if not job.request.echo or last.role != self.response_role:
            return ""
        return message_text(last.content, len(job.request.messages) - 1)

    def _logprobs(self, job: ChatJob, seq: CompletionOutput, start: int) -> Any:
        if job.num_top_logprobs is None or seq.logprobs is None:
            return None
        return chat_logprobs(
            seq.token_ids[start:], list(seq.logprobs[start:]), job.num_top_logprobs, job.render_token
        )

    def _usage(self, job: ChatJob, final: RequestOutput | None) -> UsageInfo:
        completion_tokens = sum(len(seq.token_ids) for seq in final.outputs) if final is not None else 0
        cached = final.num_cached_tokens if final is not None else None
        return usage(len(job.prompt.prompt_ids), completion_tokens, cached, self.enable_prompt_tokens_details)

    async def _collect(self, job: ChatJob) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async with aclosing(self.generate([job.prompt], job.lora_request, job.model_name)) as outputs:
            async for _, output in outputs:
                final = output
        assert final is not None, "the engine finished a request without any output"
        choices = []
        for seq in sorted(final.outputs, key=lambda s: s.index):
            parser = job.tools.parser(self.tokenizer)
            message, called = response_message(
                parser, job.tools.max_calls, self.response_role, seq.text, self._echo(job)
            )
            choices.append(
                ChatCompletionChoice(
                    index=seq.index,
                    message=message,
                    logprobs=self._logprobs(job, seq, 0),
                    finish_reason=finish_reason(seq.finish_reason, called),
                    stop_reason=seq.stop_reason,
                    token_ids=list(seq.token_ids) if job.request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=job.request_id,
            model=job.model_name,
            choices=choices,
            usage=self._usage(job, final),
            prompt_logprobs=(
                prompt_logprobs_json(final.prompt_logprobs, job.render_token)
                if job.request.prompt_logprobs is not None
                else None
            ),
            prompt_token_ids=list(final.prompt_token_ids) if job.request.return_token_ids else None,
        )

    def _chunk(
        self,
        job: ChatJob,
        choices: list[ChatStreamChoice],
        usage_info: UsageInfo | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        chunk = ChatCompletionChunk(
            id=job.request_id,
            model=job.model_name,
            choices=choices,
            usage=usage_info,
            prompt_token_ids=prompt_token_ids,
        )
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    def _delta(self, job: ChatJob, seq: CompletionOutput) -> list[ChatStreamChoice]:
        """What `seq` adds since the last chunk, one choice per chunk: its text, or (read for tool
        calls) its content and call deltas; the step's logprobs and token ids ride on the first, the
        finish reason on the last."""
        sent_tokens = job.sent_tokens.get(seq.index, 0)
        if seq.index in job.finished or (len(seq.token_ids) == sent_tokens and not seq.finished()):
            return []
        sent_chars = job.sent_chars.get(seq.index, 0)
        deltas = [DeltaMessage(content=seq.text[sent_chars:])]
        reason = seq.finish_reason
        stream = job.tool_streams.get(seq.index)
        parser = job.tools.parser(self.tokenizer) if stream is None else None
        if parser is not None:
            stream = job.tool_streams[seq.index] = new_stream(parser, job.tools.max_calls)
        if stream is not None:
            deltas = [delta_message(d) for d in stream.update(seq.text, final=seq.finished())]
            reason = finish_reason(reason, stream.tools_called)
            if not deltas and (
                seq.finished() or job.num_top_logprobs is not None or job.request.return_token_ids
            ):
                deltas = [DeltaMessage()]  # held-back text: the tokens' logprobs and ids still go out
        choices = [ChatStreamChoice(index=seq.index, delta=delta) for delta in deltas]
        if choices:
            first, last = choices[0], choices[-1]
            first.logprobs = self._logprobs(job, seq, sent_tokens)
            first.token_ids = list(seq.token_ids[sent_tokens:]) if job.request.return_token_ids else None
            last.finish_reason, last.stop_reason = reason, seq.stop_reason
        job.sent_chars[seq.index], job.sent_tokens[seq.index] = len(seq.text), len(seq.token_ids)
        if seq.finished():
            job.finished.add(seq.index)
        return choices

    def _role_chunks(self, job: ChatJob, first: RequestOutput, continuous: bool) -> list[str]:
        """Each choice's role chunk (the first with return_token_ids' prompt_token_ids), then its
        echoed text, as vLLM sends them."""
        ids = list(first.prompt_token_ids) if job.request.return_token_ids else None
        running = usage(len(job.prompt.prompt_ids), 0, None, False) if continuous else None
        echo = self._echo(job)
        lines = []
        for i in range(num_choices(job.prompt.sampling_params)):
            role = ChatStreamChoice(index=i, delta=DeltaMessage(role=self.response_role, content=""))
            lines.append(self._chunk(job, [role], running, ids if i == 0 else None))
            if echo:
                lines.append(
                    self._chunk(job, [ChatStreamChoice(index=i, delta=DeltaMessage(content=echo))], running)
                )
        return lines

    async def _stream(self, job: ChatJob) -> AsyncIterator[str]:
        options = job.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        num_prompt = len(job.prompt.prompt_ids)
        final: RequestOutput | None = None
        async with aclosing(self.generate([job.prompt], job.lora_request, job.model_name)) as outputs:
            async for _, output in outputs:
                if final is None:  # the role chunks wait for the first output: early errors get a status
                    for line in self._role_chunks(job, output, continuous):
                        yield line
                final = output
                for seq in output.outputs:  # one choice per chunk, as OpenAI and vLLM send them
                    for choice in self._delta(job, seq):
                        running = usage(num_prompt, len(seq.token_ids), None, False) if continuous else None
                        yield self._chunk(job, [choice], running)
        if include_usage:
            yield self._chunk(job, [], self._usage(job, final))
        yield "data: [DONE]\n\n"
