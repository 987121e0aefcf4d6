"""Pydantic models of the OpenAI-compatible API: request bodies, responses and stream chunks.

Request numbers and flags are strict JSON types: `"max_tokens": "16"` or `"ignore_eos": "yes"` is a 400
naming the field, never coerced (pydantic's lax mode, vLLM's, would read them as 16 and true); an
integer is still a number where a float is expected (`"temperature": 1`), a float never an integer.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
)

TokenId = Annotated[StrictInt, Field(ge=0)]
# Stop strings are matched against the new text of every sequence at every step: bound that work.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
# Each bad word is tokenized twice per request (on the tokenizer pool); a step then looks up one
# suffix per distinct bad-word length, whatever their number.
MAX_BAD_WORDS = 1024


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted (OpenAI clients send new ones often) and reported by the serving layer.
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # usage in every chunk (vLLM)


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    # "schema" in JSON; another name here, since pydantic models have a `schema` method.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format, plus vLLM's structural_tag (its other fields kept as extras)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class AdapterWeight(OpenAIBaseModel):
    """One adapter of a mix (`adapters`): its name and weight."""

    name: str
    weight: StrictFloat | StrictInt = 1.0


class LlamaCppLoRA(OpenAIBaseModel):
    """llama.cpp's per-request adapter entry (`lora`): the adapter's index in GET /lora-adapters."""

    id: StrictInt
    scale: StrictFloat | StrictInt = 1.0


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions, with vLLM's extra sampling parameters."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    n: StrictInt = Field(default=1, ge=1, le=128)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: StrictFloat | None = 0.0
    frequency_penalty: StrictFloat | None = 0.0
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # token id -> bias, clamped to [-100, 100]
    # vLLM's token controls: the only tokens that may be sampled, words never to generate.
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM extensions (the openai client sends them through `extra_body`).
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False  # logprobs tokens as "token_id:<id>" (exact, for clients)
    # vLLM's request fields of the serving layer (vllm_fields.py applies them).
    prompt_logprobs: StrictInt | None = None  # -1: the whole vocabulary
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = (
        None  # keep the last k; -1: max_model_len
    )
    # Which end truncate_prompt_tokens keeps (vLLM PR #43260): "left" cuts the start (the default),
    # "right" the end.
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: StrictBool | None = None  # prompt_token_ids and token_ids in the response
    request_id: str | None = None  # the response id's suffix (vLLM: "<prefix>-<request_id>")
    priority: StrictInt = 0  # lower runs first, with --scheduling-policy priority
    # Beam search (beam_request.py): width n (best_of when larger), transformers' scoring and stopping.
    use_beam_search: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    length_penalty: StrictFloat = 1.0
    early_stopping: StrictBool | Literal["never"] = False
    cache_salt: str | None = None  # salts this request's prefix-cache keys
    # The adapter's scale and adapter mixes (adapter_selection.py reads them).
    lora_scale: StrictFloat | StrictInt | None = None
    adapters: Annotated[list[AdapterWeight], Field(max_length=64)] | None = None
    lora: Annotated[list[LlamaCppLoRA], Field(max_length=64)] | None = None  # llama.cpp's form
    # Structured outputs (structured_request.py maps them): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = Field(
        default=None, ge=-1
    )  # -1: the whole vocabulary; capped by --max-logprobs
    echo: StrictBool | None = False
    suffix: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = (
        None  # an assistant's earlier calls (tool_request.py checks them)
    )
    tool_call_id: str | None = None  # a tool result's call


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type "object"

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = None if value is None else value.get("type", "object")
        if value is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ValueError(
                f"a function's parameters must be a JSON Schema of type 'object', got type {kind!r}"
            )
        return value


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None  # -1: the whole vocabulary (vLLM)
    tools: list[ChatCompletionToolsParam] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} (tool_request.py
    # checks it with vLLM's texts)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = True
    add_generation_prompt: StrictBool = True
    chat_template: str | None = None  # refused unless the server trusts request templates
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: StrictBool = False  # the last (assistant) message is continued, not closed
    echo: StrictBool = False  # vLLM: the reply starts with the last message when its role is the reply's
    documents: list[dict[str, Any]] | None = None  # passed to the chat template (RAG templates)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # with --enable-prompt-tokens-details


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM: prompt_logprobs (token id -> {logprob, rank, decoded_token} per prompt position, the first
    # None) and, with return_token_ids, the token ids.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class FingerprintedResponse(OpenAIBaseModel):
    """A completion or chat response (or stream chunk): vLLM's and OpenAI's `system_fingerprint` and
    `service_tier` keys are always there, null here, even in a stream chunk dumped without its other
    null fields (clients read the keys)."""

    system_fingerprint: str | None = None
    service_tier: str | None = None

    @model_serializer(mode="wrap")
    def _keep_null_keys(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            data.setdefault("system_fingerprint", self.system_fingerprint)
            data.setdefault("service_tier", self.service_tier)
        return data


class CompletionResponse(FingerprintedResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None  # with type and the name, in a call's first delta only
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(FingerprintedResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


class ChatCompletionChunk(FingerprintedResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "loraserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    digest: str | None = None  # an adapter version's content digest (sha256 hex)
    version: str | None = None  # its label, when the load request gave one


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    # Optional here so that a missing field gets vLLM's "must be provided" InvalidUserInput answer.
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: StrictBool = False  # replace the weights of an adapter loaded under this name
    version: StrictStr | None = None  # a label for the version loaded: name@label addresses it


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str | None = None
    lora_int_id: StrictInt | None = None
