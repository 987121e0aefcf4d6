"""Pydantic models of the Responses API (`/v1/responses`): the request body and the response object,
in OpenAI's shapes (the openai client's `Response` reads them) with vLLM's extra request fields.

Numbers and flags are strict JSON types, as on the other routes. `input`, `tools` and `tool_choice`
stay plain JSON here: `request_items.py` reads them item by item, so that an item or a tool the server
does not offer is a 400 naming it, not a pydantic union error. Output items are plain dicts (the
shapes `output_items.py` builds), the same in the response, the stream's events and the store.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from loraserve.entrypoints.openai.serving.protocol import (
    MAX_STOP_STRINGS,
    AdapterWeight,
    LlamaCppLoRA,
    OpenAIBaseModel,
    StopString,
)

# OpenAI's metadata limits: 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA_PAIRS = 16
MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]


def new_id(prefix: str) -> str:
    """OpenAI's id form: `<prefix>_<hex>` (resp, msg, fc, call)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    # "schema" in JSON; another name here, since pydantic models have a `schema` method.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # only "medium" (the default) is served


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses. The fields after `stream` are vLLM's extras (the openai client sends them
    through `extra_body`), applied as on chat completions."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = True
    text: TextConfig | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None  # OpenAI's successor of `user`: echoed
    prompt_cache_key: StrictStr | None = None  # a routing hint; every request shares the prefix cache
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = None
    background: StrictBool | None = False
    stream: StrictBool | None = False
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[StrictInt, Field(ge=1)] | None = None
    # vLLM's extras
    request_id: StrictStr | None = None  # the response is "resp_<request_id>"
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: StrictBool = False
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    lora_scale: StrictFloat | StrictInt | None = None
    adapters: Annotated[list[AdapterWeight], Field(max_length=64)] | None = None
    lora: Annotated[list[LlamaCppLoRA], Field(max_length=64)] | None = None


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponseObject(BaseModel):
    """OpenAI's `Response`: what POST /v1/responses returns, the stream's lifecycle events carry and
    GET /v1/responses/{id} reads back."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Status = "in_progress"
    background: bool = False
    error: dict[str, Any] | None = None  # {"code", "message"} when failed
    incomplete_details: dict[str, Any] | None = None  # {"reason": "max_output_tokens"}
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "auto"
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
