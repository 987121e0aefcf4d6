"""vLLM's routes beside the OpenAI ones: /ping and /invocations (SageMaker), /load (in-flight
generation requests, counted with --enable-server-load-tracking), /tokenize, /detokenize and
/tokenizer_info (with --enable-tokenizer-info-endpoint).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loraserve.entrypoints.openai.serving.errors import APIError, api_error_from_exception, error_response
from loraserve.entrypoints.openai.serving.serving_tokenization import (
    DetokenizeRequest,
    OpenAIServingTokenization,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)


@dataclass(slots=True)
class LoadTracker:
    """vLLM's `server_load`: generation requests in flight (a stream counts until its last chunk)."""

    enabled: bool = False
    server_load: int = 0

    def begin(self) -> None:
        if self.enabled:
            self.server_load += 1

    def end(self) -> None:
        if self.enabled:
            self.server_load -= 1

    async def until_done(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """`lines`, with this request counted until the stream ends (or is abandoned)."""
        try:
            async for line in lines:
                yield line
        finally:
            self.end()


Handler = Callable[[Any, Request], Awaitable[Response]]


def add_vllm_routes(
    app: FastAPI,
    health: Callable[[], Awaitable[Response]],
    tracker: LoadTracker,
    tokenization: OpenAIServingTokenization,
    handlers: list[tuple[type[pydantic.BaseModel], Handler]],
    tokenizer_info: bool,
) -> None:
    """Register the routes; `handlers` are the generation endpoints /invocations dispatches to, in
    vLLM's order (chat, then completions)."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": tracker.server_load})

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        try:
            body = json.loads(await raw_request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"JSON decode error: {exc}", HTTPStatus.BAD_REQUEST)
        for model, handler in handlers:
            try:
                request = model.model_validate(body)
            except pydantic.ValidationError:
                continue
            return await handler(request, raw_request)
        names = [model.__name__ for model, _ in handlers]
        return error_response(
            f"Cannot find suitable handler for request. Expected one of: {names}", HTTPStatus.BAD_REQUEST
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> Response:
        return await _json(tokenization.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await _json(tokenization.detokenize(body))

    if tokenizer_info:

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> Response:
            try:
                return JSONResponse(tokenization.tokenizer_info())
            except APIError as exc:
                return exc.response()


async def _json(result: Awaitable[pydantic.BaseModel]) -> Response:
    try:
        return JSONResponse((await result).model_dump(exclude_none=True))
    except Exception as exc:
        return api_error_from_exception(exc).response()
