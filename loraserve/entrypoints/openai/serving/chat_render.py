"""The chat prompt: messages (with their tool fields) and tools rendered by the chat template.

A template is code the server runs: a request's own template only with --trust-request-chat-template,
and a role is prompt text, so only known roles pass (`chat_roles.py`). Rendering runs on a tokenizer
thread (its cost grows with the messages).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.chat_roles import allowed_roles, check_roles, templates_of
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import ChatCompletionRequest
from loraserve.entrypoints.openai.serving.tool_request import template_message


def render_chat(
    tokenizer: Any,
    request: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None,
    trust_request_chat_template: bool,
    images: bool = False,
    fallback_template: str | None = None,
) -> str:
    """The prompt text from the tokenizer's chat template; 400 for messages the template refuses.
    `images`: the messages hold image parts (checked already), each rendered as the template's image
    placeholder. `fallback_template`: the template used where the tokenizer has none (a
    vision-language model's processor often holds it)."""
    kwargs = dict(request.chat_template_kwargs or {})
    if tools is not None:  # transformers' `tools`: the template lists them
        kwargs["tools"] = tools
    if request.chat_template is not None:
        kwargs["chat_template"] = request.chat_template
    if request.documents is not None:  # RAG templates read them (transformers' `documents`)
        kwargs["documents"] = request.documents
    if request.continue_final_message:  # prefill the assistant's turn: the template leaves it open
        kwargs["continue_final_message"] = True
    # A template is code run on the server (loops, allocations): only the operator may allow it.
    if "chat_template" in kwargs and not trust_request_chat_template:
        raise APIError(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            HTTPStatus.BAD_REQUEST,
            "chat_template",
        )
    if (
        not kwargs.get("chat_template")
        and not getattr(tokenizer, "chat_template", None)
        and fallback_template
    ):
        kwargs["chat_template"] = fallback_template  # a vision-language model's processor's template
    if not kwargs.get("chat_template") and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            "The model's tokenizer has no chat template, so chat completions are unavailable; "
            "use /v1/completions.",
            HTTPStatus.BAD_REQUEST,
            "messages",
        )
    # A role is printed into the prompt: only known roles, never template control text.
    own = getattr(tokenizer, "chat_template", None)
    templates = [*templates_of(kwargs.get("chat_template")), *templates_of(own)]
    check_roles([m.role for m in request.messages], allowed_roles(templates))
    content = template_content if images else message_text
    messages = [template_message(m, i, content(m.content, i)) for i, m in enumerate(request.messages)]
    try:
        rendered = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            **kwargs,
        )
    except Exception as exc:  # jinja2 errors (raise_exception in templates) and bad kwargs
        raise APIError(
            f"The chat template rejected the messages: {exc}", HTTPStatus.BAD_REQUEST, "messages"
        ) from exc
    return str(rendered)


def message_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """A message's text: its string, or its text parts joined; 400 for other parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                f"messages[{index}].content: only text parts are supported, got type {part.get('type')!r}.",
                HTTPStatus.BAD_REQUEST,
                "messages",
            )
        parts.append(part["text"])
    return "".join(parts)


def template_content(content: str | list[dict[str, Any]] | None, index: int) -> str | list[dict[str, Any]]:
    """A message's content for a vision-language chat template: its text, or, when it has images, its
    parts in order as transformers' templates take them ({"type": "text", "text"}, {"type": "image"})."""
    if content is None or isinstance(content, str):
        return content or ""
    if not any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return message_text(content, index)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise APIError(
                f"messages[{index}].content[{j}]: only text and image_url parts are supported, got type {kind!r}.",
                HTTPStatus.BAD_REQUEST,
                f"messages[{index}].content[{j}]",
            )
    return parts
