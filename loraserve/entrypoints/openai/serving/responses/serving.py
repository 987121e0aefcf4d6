"""OpenAIServingResponses: POST /v1/responses (whole, streamed, or in the background), GET, cancel and
DELETE of stored responses.

A request becomes a chat request (`request_items.py`, after the stored conversation of
`previous_response_id`) that the chat handler prepares as for /v1/chat/completions (template, tool
plan, grammar, sampling params, the adapter from `model`) and runs through the same engine requests,
so responses share batches with chat and completion requests. Its text is read into output items
(`output_items.py`), streamed as OpenAI's events (`events.py`), and stored (`store.py`) with the
conversation it ends when `store` is true. A background response is created "queued", runs as a task
and is found in the store; cancelling it aborts its engine request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError, api_error_from_exception
from loraserve.entrypoints.openai.serving.responses.events import TERMINAL_EVENTS, EventWriter
from loraserve.entrypoints.openai.serving.responses.output_items import OutputAssembler
from loraserve.entrypoints.openai.serving.responses.protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)
from loraserve.entrypoints.openai.serving.responses.request_checks import check_offered
from loraserve.entrypoints.openai.serving.responses.request_items import (
    chat_request,
    input_messages,
    responses_param,
)
from loraserve.entrypoints.openai.serving.responses.store import ResponseStore
from loraserve.entrypoints.openai.serving.serving_chat import ChatJob, OpenAIServingChat
from loraserve.outputs import RequestOutput

_CONTINUABLE = ("completed", "incomplete")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, request: ResponsesRequest) -> ResponseObject | AsyncIterator[str]:
        """The response; a stream's events (the first waits for output); or, in the background, the
        queued response at once."""
        check_offered(request)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, "previous_response_id")
            if previous.response["status"] not in _CONTINUABLE:
                raise APIError(
                    f"Previous response '{request.previous_response_id}' is {previous.response['status']}: "
                    "only a completed or incomplete response can be continued.",
                    HTTPStatus.BAD_REQUEST,
                    "previous_response_id",
                )
            history = previous.conversation
        chat, conversation = chat_request(request, history)
        response_id = f"resp_{request.request_id}" if request.request_id else new_id("resp")
        try:
            job = await self.chat.prepare(chat, response_id)
        except APIError as exc:  # the chat path names chat's fields
            exc.param = responses_param(exc.param)
            raise
        response = _initial(request, job, response_id)
        if request.background:
            return self._start_background(job, response, conversation)
        if request.stream:
            return self._stream(job, response, conversation)
        return await self._collect(job, response, conversation)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).response

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response (its engine request is aborted); a finished one is a 400."""
        entry = self.store.get(response_id)
        if not entry.response.get("background"):  # OpenAI's text
            raise APIError("Cannot cancel a synchronous response.", HTTPStatus.BAD_REQUEST, "response_id")
        if entry.task is not None:
            entry.task.cancel()
            await asyncio.wait([entry.task])
        stored = self.store.get(response_id).response
        if stored["status"] != "cancelled":
            raise APIError(
                f"Cannot cancel a response that already finished (status '{stored['status']}').",
                HTTPStatus.BAD_REQUEST,
                "response_id",
            )
        return stored

    async def delete(self, response_id: str) -> DeletedResponse:
        entry = self.store.get(response_id)
        if entry.task is not None:
            entry.task.cancel()
            await asyncio.wait([entry.task])
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    def _assembler(self, job: ChatJob, events: EventWriter | None) -> OutputAssembler:
        json_text = job.request.response_format is not None  # text.format json_schema / json_object
        return OutputAssembler(job.tools.parser(self.chat.tokenizer), job.tools.max_calls, events, json_text)

    def _outputs(self, job: ChatJob) -> Any:
        return self.chat.generate([job.prompt], job.lora_request, job.model_name)

    async def _generate(self, job: ChatJob, started: Callable[[], None] | None = None) -> RequestOutput:
        """The request's final output; `started` is called at its first."""
        final: RequestOutput | None = None
        async with aclosing(self._outputs(job)) as outputs:
            async for _, output in outputs:
                if final is None and started is not None:
                    started()
                final = output
        assert final is not None, "the engine finished a request without any output"
        return final

    def _complete(
        self, job: ChatJob, response: ResponseObject, conversation: list[dict[str, Any]], final: RequestOutput
    ) -> None:
        """The finished text read into items at once (what a stream's assembly ends with)."""
        assembler = self._assembler(job, None)
        seq = final.outputs[0]
        assembler.update(seq.text, final=True)
        assembler.finish(seq.finish_reason == "length")
        self._finish(job, response, conversation, final, assembler)

    async def _collect(
        self, job: ChatJob, response: ResponseObject, conversation: list[dict[str, Any]]
    ) -> ResponseObject:
        self._complete(job, response, conversation, await self._generate(job))
        return response

    async def _stream(
        self, job: ChatJob, response: ResponseObject, conversation: list[dict[str, Any]]
    ) -> AsyncIterator[str]:
        events = EventWriter()
        assembler = self._assembler(job, events)
        final: RequestOutput | None = None
        try:
            async with aclosing(self._outputs(job)) as outputs:
                async for _, output in outputs:
                    if final is None:  # the first events wait for output: early errors get a status
                        yield events.lifecycle("response.created", response)
                        yield events.lifecycle("response.in_progress", response)
                    final = output
                    seq = output.outputs[0]
                    for line in assembler.update(seq.text, seq.finished()):
                        yield line
        except Exception as exc:
            if final is None:
                raise
            self._fail(response, conversation, exc)
            yield events.lifecycle("response.failed", response)
            return
        assert final is not None, "the engine finished a request without any output"
        lines = assembler.finish(final.outputs[0].finish_reason == "length")
        self._finish(job, response, conversation, final, assembler)
        for line in lines:
            yield line
        yield events.lifecycle(TERMINAL_EVENTS[response.status], response)

    def _start_background(
        self, job: ChatJob, response: ResponseObject, conversation: list[dict[str, Any]]
    ) -> ResponseObject:
        if self.store.num_running() >= self.store.max_responses:
            raise APIError(
                f"{self.store.num_running()} background responses are running, as many as the store holds "
                "(--responses-store-max-responses); retry once some have finished.",
                HTTPStatus.SERVICE_UNAVAILABLE,
                "background",
                headers={"Retry-After": "1"},
            )
        response.status = "queued"
        task = asyncio.get_running_loop().create_task(self._run_background(job, response, conversation))
        self.store.put(response.model_dump(mode="json"), conversation, task)
        return response.model_copy(deep=True)

    async def _run_background(
        self, job: ChatJob, response: ResponseObject, conversation: list[dict[str, Any]]
    ) -> None:
        def started() -> None:
            response.status = "in_progress"
            self._update(response, conversation)

        try:
            self._complete(job, response, conversation, await self._generate(job, started))
        except asyncio.CancelledError:
            response.status = "cancelled"
            self._update(response, conversation)
        except Exception as exc:
            self._fail(response, conversation, exc)
        finally:
            self.store.finished(response.id)

    def _finish(
        self,
        job: ChatJob,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
        final: RequestOutput,
        assembler: OutputAssembler,
    ) -> None:
        """The response as it ended: its items, status, usage; stored with the conversation it ends."""
        seq = final.outputs[0]
        response.output = assembler.items
        if seq.finish_reason == "length":
            response.status, response.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            response.status = "completed"
        response.completed_at = int(time.time())
        num_input = len(job.prompt.prompt_ids)
        response.usage = ResponseUsage(
            input_tokens=num_input,
            output_tokens=len(seq.token_ids),
            total_tokens=num_input + len(seq.token_ids),
        )
        response.usage.input_tokens_details.cached_tokens = final.num_cached_tokens or 0
        self._update(response, [*conversation, *input_messages(assembler.items)])

    def _fail(self, response: ResponseObject, conversation: list[dict[str, Any]], exc: BaseException) -> None:
        error = api_error_from_exception(exc)
        code = "rate_limit_exceeded" if error.status in (429, 503) else "server_error"
        if 400 <= error.status < 500 and error.status != 429:
            code = "invalid_prompt"
        response.status, response.error = "failed", {"code": code, "message": error.message}
        self._update(response, conversation)

    def _update(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        """Store the response as it is now (a background one only while the store still has it: a
        DELETE during its run is final)."""
        if not response.store:
            return
        if response.background and not self.store.contains(response.id):
            return
        self.store.put(response.model_dump(mode="json"), conversation)


def _initial(request: ResponsesRequest, job: ChatJob, response_id: str) -> ResponseObject:
    """The response as created: the request's settings, echoed as OpenAI echoes them."""
    params = job.prompt.sampling_params
    text_format = request.text.format if request.text is not None else None
    return ResponseObject(
        id=response_id,
        background=bool(request.background),
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        model=job.model_name,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        service_tier=request.service_tier or "auto",
        store=request.store is not False,
        temperature=getattr(params, "temperature", request.temperature),
        text={
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        tool_choice=request.tool_choice or "auto",
        tools=list(request.tools or []),
        top_p=getattr(params, "top_p", request.top_p),
        truncation=request.truncation or "disabled",
        user=request.user,
        safety_identifier=request.safety_identifier,
        prompt_cache_key=request.prompt_cache_key,
        metadata=dict(request.metadata or {}),
    )
