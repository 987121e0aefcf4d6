"""Error responses of the HTTP API: one JSON shape, the right status, and no internal details leaked.

Every error is `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status. The type
follows the status, except where vLLM names it otherwise and clients match it (`InvalidUserInput` for
the adapter routes' refusals).
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from loraserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    LoRAAdapterChangedError,
    LoRAAdapterError,
    LoRAAdapterNotFoundError,
    LoRAAdapterUnavailableError,
)

logger = logging.getLogger(__name__)

_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# vLLM's error.type for a refused adapter load or unload (missing fields, duplicate name, bad adapter).
INVALID_USER_INPUT = "InvalidUserInput"
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_OBJECT_REPR = re.compile(r"<([\w.]+) object at <address>>")


class APIError(Exception):
    """An error the serving layer answers with directly: status, message and the offending parameter."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type  # None: the status's type
        self.headers = headers  # e.g. Retry-After on a 503

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status, self.param, self.err_type, self.headers)


def sanitize(message: str) -> str:
    """Drop memory addresses (and the object reprs built around them) from a message, and escape what
    UTF-8 cannot encode (a lone surrogate from the request would otherwise break the response itself)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return _OBJECT_REPR.sub(r"<\1>", _ADDRESS.sub("<address>", message))


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict:
    kind = err_type or error_type(status)
    return {"error": {"message": sanitize(message), "type": kind, "param": param, "code": status}}


def error_response(
    message: str, status: int, param: str | None = None, err_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, err_type), status_code=status, headers=headers)


def sse_error(message: str, status: int, param: str | None = None, err_type: str | None = None) -> str:
    """An error as a server-sent event, for failures after a stream has started."""
    return f"data: {json.dumps(error_body(message, status, param, err_type))}\n\n"


def api_error_from_exception(exc: BaseException) -> APIError:
    """Map an exception from the engine or serving layer onto an APIError with its HTTP status."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineShutdownError):
        return APIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, LoRAAdapterNotFoundError):
        return APIError(str(exc), HTTPStatus.NOT_FOUND)
    if isinstance(exc, LoRAAdapterUnavailableError):
        return APIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, param="model", headers={"Retry-After": "1"})
    if isinstance(exc, LoRAAdapterChangedError):
        return APIError(str(exc), HTTPStatus.CONFLICT, param="model")
    if isinstance(exc, (LoRAAdapterError, ValueError)):
        # SamplingParamsError names its field (vLLM's VLLMValidationError `parameter`).
        param = getattr(exc, "parameter", None) or _param_from_message(str(exc))
        return APIError(str(exc), HTTPStatus.BAD_REQUEST, param=param)
    if isinstance(exc, EngineDeadError):
        return APIError(f"The engine is dead: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)
    logger.error("Internal error while serving a request", exc_info=exc)
    # An OSError's text names its file (a server path): the body keeps only the reason, the log all.
    detail = (exc.strerror or "I/O error") if isinstance(exc, OSError) else str(exc)
    return APIError(f"Internal server error: {type(exc).__name__}: {detail}", HTTPStatus.INTERNAL_SERVER_ERROR)


_PARAMS = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "best_of",
}


def _param_from_message(message: str) -> str | None:
    # SamplingParams messages start with the field's name ("top_p must be in (0, 1], got 2.0.").
    first = message.split(" ", 1)[0]
    return first if first in _PARAMS else None
