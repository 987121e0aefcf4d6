"""Answering a generation route: a handler's whole response as JSON, or its stream as server-sent
events that start only once the first event (or the first error) is known; the request counts in
the /load tracker until its response or stream is done. A failure mid-stream becomes an error event
(the Responses API's streams report their own failures as `response.failed` events)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from loraserve.entrypoints.openai.server.disconnect import ClientDisconnected, run_until_disconnect
from loraserve.entrypoints.openai.server.vllm_routes import LoadTracker
from loraserve.entrypoints.openai.serving.errors import api_error_from_exception, sse_error
from loraserve.entrypoints.openai.serving.protocol import SamplingRequest


def take_request_id_header(body: SamplingRequest, raw_request: Request) -> None:
    """vLLM names the response after the X-Request-Id header when there is one, over `request_id`."""
    header = raw_request.headers.get("x-request-id")
    if header:
        body.request_id = header


async def respond(
    raw_request: Request,
    handle: Callable[[], Awaitable[BaseModel | AsyncIterator[str]]],
    tracker: LoadTracker,
) -> Response:
    """Run a generation handler; a stream starts only once its first chunk (or first error) is known.
    The request counts in `tracker` (/load) until its response or stream is done."""

    async def produce() -> Response:
        result = await handle()
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump(exclude_none=False))
        first = await anext(result)
        return StreamingResponse(
            tracker.until_done(continue_stream(first, result)), media_type="text/event-stream"
        )

    tracker.begin()
    response: Response | None = None
    try:
        response = await run_until_disconnect(raw_request, produce())
        return response
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        return api_error_from_exception(exc).response()
    finally:
        if not isinstance(response, StreamingResponse):  # a stream ends its count when it ends
            tracker.end()


async def continue_stream(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE lines; a failure mid-stream becomes an error event followed by [DONE]."""
    yield first
    try:
        async for line in rest:
            yield line
    except Exception as exc:
        error = api_error_from_exception(exc)
        yield sse_error(error.message, error.status, error.param, error.err_type)
        yield "data: [DONE]\n\n"
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
