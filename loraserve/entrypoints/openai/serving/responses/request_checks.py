"""What a Responses request may ask for beyond text and function tools: each field this server does
not offer is a 400 naming it (never silently ignored), with OpenAI's and vLLM's texts where they
have one. Values that ask for nothing (`reasoning: {}`, `include: []`, `truncation: "disabled"`,
`service_tier: "auto"`) are accepted.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.responses.protocol import ResponsesRequest
from loraserve.entrypoints.openai.serving.vllm_extras import refuse_unsupported_extras

logger = logging.getLogger(__name__)

# OpenAI request fields that this server does not offer, by what they would need.
_NOT_OFFERED = {
    "conversation": "the Conversations API is not served; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not served; send the instructions and input",
    "context_management": "server-side context compaction is not offered",
}
_OFF: tuple[Any, ...] = (None, False, [], {}, "")


def check_offered(request: ResponsesRequest) -> None:
    """APIError 400 for the first field whose value asks for something this server does not do."""
    reasoning = request.reasoning or {}
    if any(value is not None for value in reasoning.values()):
        asked = ", ".join(f"reasoning.{key}" for key, value in reasoning.items() if value is not None)
        raise _error(
            f"reasoning is not offered: the model served here does not reason (got {asked}).", "reasoning"
        )
    for value in request.include or []:
        raise _error(f"include: {value!r} is not offered by this server.", "include")
    if request.top_logprobs:
        raise _error(
            "top_logprobs is not offered by the Responses API here; use chat completions.", "top_logprobs"
        )
    if request.truncation == "auto":
        raise _error(
            'truncation "auto" is not offered: an input longer than the context is refused ("disabled").',
            "truncation",
        )
    if request.service_tier not in (None, "auto", "default"):
        raise _error(
            f'service_tier {request.service_tier!r} is not offered; use "auto" or "default".', "service_tier"
        )
    verbosity = request.text.verbosity if request.text is not None else None
    if verbosity not in (None, "medium"):
        raise _error(f'text.verbosity {verbosity!r} is not offered (only "medium").', "text.verbosity")
    if request.background and request.store is False:  # vLLM's text
        raise _error("background can only be used when `store` is true", "background")
    if request.background and request.stream:
        raise _error(
            "background together with stream is not offered: create the response in the background, then "
            "poll GET /v1/responses/{id}.",
            "background",
        )
    extras: dict[str, Any] = dict(request.model_extra or {})
    for name, why in _NOT_OFFERED.items():
        if extras.get(name) not in _OFF:
            raise _error(f"{name} is not offered by this server: {why}.", name)
    refuse_unsupported_extras(extras, is_chat=True)  # vLLM's extras that would change the result
    if request.unknown_fields():
        logger.debug("Ignoring unknown Responses request fields: %s", request.unknown_fields())


def _error(message: str, param: str) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)
