"""POST /tokenize, POST /detokenize and GET /tokenizer_info: vLLM's tokenizer endpoints.

/tokenize takes a completion-style `prompt` or chat `messages` (and `tools`, rendered with the chat
template as chat completions render them) and returns the token ids, their count and max_model_len; `model`
resolves as for generation (an adapter shares the base tokenizer). /detokenize returns the text of
token ids. /tokenizer_info (with --enable-tokenizer-info-endpoint) returns the tokenizer's
configuration without file paths.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from pydantic import Field, StrictBool, model_validator

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    ChatMessage,
    OpenAIBaseModel,
    TokenId,
)
from loraserve.entrypoints.openai.serving.serving_chat import OpenAIServingChat
from loraserve.entrypoints.openai.serving.tool_request import template_tools


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ChatCompletionToolsParam] | None = None  # rendered by the template, as chat renders them

    @model_validator(mode="before")
    @classmethod
    def _both_prompts(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("continue_final_message")
            and data.get("add_generation_prompt", True)
        ):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class OpenAIServingTokenization:
    """The tokenizer endpoints, over the chat endpoint's rendering and the serving layer's checks."""

    def __init__(self, chat: OpenAIServingChat, chat_template: str | None = None) -> None:
        self.chat = chat
        self.chat_template = chat_template  # --chat-template, as /tokenizer_info reports it

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        chat = self.chat
        await self._resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            rendered = ChatCompletionRequest.model_validate(
                request.model_dump(exclude={"add_special_tokens", "return_token_strs"}, exclude_none=True)
            )
            text = await chat.in_tokenizer_thread(chat._render, rendered, template_tools(request.tools))
            ids = await chat.encode(text, add_special_tokens=request.add_special_tokens, param="messages")
        else:
            ids = await chat.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = list(await chat.in_tokenizer_thread(chat.tokenizer.convert_ids_to_tokens, ids))
        return TokenizeResponse(
            count=len(ids), max_model_len=chat.max_model_len, tokens=ids, token_strs=token_strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        chat = self.chat
        await self._resolve(request.model)
        chat.check_token_ids(request.tokens, "tokens")
        if chat.tokenizer is None:
            raise APIError(
                "This server was started with --skip-tokenizer-init: it has no tokenizer to detokenize with.",
                HTTPStatus.BAD_REQUEST,
                "tokens",
            )
        text = await chat.in_tokenizer_thread(chat.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=str(text))

    async def _resolve(self, model: str | None) -> None:
        """404 for a name that is neither the base model nor an adapter (vLLM checks it too)."""
        await self.chat.models.resolve_model(model or None)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's init kwargs (JSON-safe, no file paths), its class
        and the chat template."""
        tokenizer = self.chat.tokenizer
        if tokenizer is None:
            raise APIError("This server has no tokenizer (--skip-tokenizer-init).", HTTPStatus.NOT_FOUND)
        config = dict(getattr(tokenizer, "init_kwargs", None) or {})
        for name in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
            config.pop(name, None)
        config = {key: _json_safe(value) for key, value in config.items()}
        config["tokenizer_class"] = type(tokenizer).__name__
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return config


def _json_safe(value: Any) -> Any:
    """Values JSON can carry as they are; others (AddedToken, ...) as their text."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _json_safe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_json_safe(v) for v in value]
        return str(value)
