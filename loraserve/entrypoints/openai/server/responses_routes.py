"""The Responses API's routes: POST /v1/responses (answered like the other generation routes: JSON,
or a stream that starts once its first event is known), GET and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel. The handler is `serving/responses/serving.py`'s."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loraserve.entrypoints.openai.server.respond import respond
from loraserve.entrypoints.openai.server.vllm_routes import LoadTracker
from loraserve.entrypoints.openai.serving.responses.protocol import ResponsesRequest
from loraserve.entrypoints.openai.serving.responses.serving import OpenAIServingResponses


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses, tracker: LoadTracker) -> None:
    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        header = raw_request.headers.get("x-request-id")
        if header:  # as on the other routes, the header names the response (resp_<id>)
            body.request_id = header
        return await respond(raw_request, lambda: responses.create(body), tracker)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        return JSONResponse(await responses.cancel(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse((await responses.delete(response_id)).model_dump())
