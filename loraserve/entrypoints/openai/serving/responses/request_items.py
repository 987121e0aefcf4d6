"""A Responses request as the chat completion request that serves it, through the chat path.

`input` (a string, or items: messages with text and `input_image` parts, `function_call` and
`function_call_output`) becomes chat messages after the stored conversation of `previous_response_id`
(an `input_image` becomes chat's `image_url` part, read and checked by the chat path, whose errors
name the input item: `input[k].content[j]`), `instructions` a
system message first (never carried over from a previous response, as OpenAI's), function `tools`
chat's tools, `tool_choice` chat's (a named function `{"type": "function", "name": ...}`),
`text.format` chat's `response_format`. The chat path then renders, tokenizes, plans the tools
(parsers, grammars) and builds the sampling params exactly as for /v1/chat/completions. What is
not offered (built-in tools, files, images by `file_id`, reasoning items) is a 400 naming it.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    JsonSchemaFormat,
    ResponseFormat,
)
from loraserve.entrypoints.openai.serving.responses.protocol import ResponsesRequest, TextConfig

ROLES = ("user", "assistant", "system", "developer")
_IMAGE_ROLES = ("user", "system", "developer")  # OpenAI's input messages (an assistant's are output text)
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
# vLLM's fields that pass to the chat request as they are.
_VLLM_FIELDS = (
    "request_id", "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos", "priority",
    "cache_salt", "lora_scale", "adapters", "lora",
)  # fmt: skip
# Chat's parameter names, as the Responses request calls them (in errors from the chat path).
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def chat_request(
    request: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]], dict[int, str]]:
    """(the chat request, the conversation it continues: `history` and this input's messages,
    without the instructions, and the input item each chat message of the input comes from, by its
    index in the chat request: `responses_error` names them)."""
    tools = function_tools(request.tools)
    choice = chat_tool_choice(request.tool_choice)
    inputs, origins = _converted(request.input)
    conversation = [*history, *inputs]
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    offset = len(messages) + len(history)
    messages += conversation
    if not messages:
        raise _error("input is empty and there are no instructions: nothing to answer.", "input")
    forced = bool(tools) and (choice == "required" or isinstance(choice, dict))
    fields: dict[str, Any] = dict(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls,
        # A forced call writes no text this turn: text.format is for the turns that do.
        response_format=None if forced else response_format(request.text),
    )
    fields.update({name: getattr(request, name) for name in _VLLM_FIELDS})
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise _error(f"{where}: {first.get('msg')}", _PARAMS.get(where.split(".")[0], "input")) from exc
    return chat, conversation, {offset + m: origin for m, origin in enumerate(origins)}


def responses_param(param: str | None) -> str | None:
    """A chat parameter's name as the Responses API calls it."""
    return None if param is None else _PARAMS.get(param, param)


def responses_error(exc: APIError, origins: dict[int, str]) -> None:
    """`exc` from the chat path, its parameter and the chat messages its text names (`messages[i]`, an
    image part's) renamed as the Responses request calls them (`origins`: `chat_request`'s)."""

    def rename(match: re.Match[str]) -> str:
        return origins.get(int(match.group(1)), match.group(0))

    exc.message = _MESSAGE_INDEX.sub(rename, exc.message)
    exc.param = responses_param(_MESSAGE_INDEX.sub(rename, exc.param) if exc.param else exc.param)


_MESSAGE_INDEX = re.compile(r"\bmessages\[(\d+)\]")


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise _error(
                f"tools[{i}]: the built-in tool {kind!r} is not offered by this server; only function tools "
                "(type 'function') are served.",
                "tools",
            )
        try:
            function = FunctionDefinition.model_validate(
                {k: tool.get(k) for k in ("name", "description", "parameters") if tool.get(k) is not None}
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first.get("loc", ()))
            raise _error(f"tools[{i}].{field}: {first.get('msg')}", f"tools.{i}.{field}") from exc
        converted.append({"type": "function", "function": function.model_dump(exclude_none=True)})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A tool_choice of "none", "auto" or "required" as it is; `{"type": "function", "name": ...}` as
    chat's."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise _error(
            f'tool_choice of type {choice.get("type")!r} is not offered by this server: use "none", '
            '"auto", "required" or {"type": "function", "name": ...}.',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    """`text.format` as chat's response_format (None: free text)."""
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise _error("text.format of type 'json_schema' needs a schema.", "text.format.schema")
    schema = JsonSchemaFormat(name=fmt.name, description=fmt.description, strict=fmt.strict)
    schema.json_schema = fmt.json_schema
    return ResponseFormat(type="json_schema", json_schema=schema)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: consecutive function calls (and the assistant text before them) are
    one assistant turn; a function call's output is a tool message answering its call_id."""
    return _converted(value)[0]


def _converted(value: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """(`input_messages`, the input item each message comes from: "input[k]")."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        origins += [where] * _item_messages(messages, item, kind, where)
    return messages, origins


def _item_messages(messages: list[dict[str, Any]], item: dict[str, Any], kind: str, where: str) -> int:
    """Append `item` to `messages`; the number of messages it adds (0: a call joining a turn)."""
    before = len(messages)
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        _append_call(messages, item, where)
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        content = _text(item.get("output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
    elif kind == "reasoning":
        raise _error(
            f"{where}: reasoning items are not offered: the model served here does not reason.", "input"
        )
    else:
        raise _error(
            f"{where}: items of type {kind!r} are not offered by this server; input items are messages "
            "(text and images), function_call and function_call_output.",
            "input",
        )
    return len(messages) - before


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _error(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}.", "input")
    content = item.get("content")
    if role in _IMAGE_ROLES and isinstance(content, list) and any(_is_image(part) for part in content):
        return {"role": role, "content": _image_content(content, f"{where}.content")}
    return {"role": role, "content": _text(content, f"{where}.content")}


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _image_content(content: list[Any], where: str) -> list[dict[str, Any]]:
    """Text and `input_image` parts as chat's `text` and `image_url` parts, in order."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not _is_image(part):
            parts.append({"type": "text", "text": _text_part(part, f"{where}[{j}]")})
            continue
        url = part.get("image_url")
        if part.get("file_id") is not None and url is None:
            raise _error(
                f"{where}[{j}]: images by file_id are not offered: the Files API is not served here; "
                "send image_url (a data:, file:// or http(s) URL).",
                "input",
            )
        if not isinstance(url, str) or not url:
            raise _error(f"{where}[{j}].image_url must be a non-empty string (a URL).", "input")
        detail = part.get("detail")
        parts.append(
            {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
        )
    return parts


def _append_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise _error(f"{where}.arguments must be a string (JSON text).", "input")
    call = {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined; other parts (images here, files, audio) are a 400 naming them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"{where} must be a string or a list of content parts.", "input")
    return "".join(_text_part(part, f"{where}[{j}]") for j, part in enumerate(content))


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = _TEXT_PARTS.get(str(kind))
    if key is None:
        raise _error(
            f"{where}: content of type {kind!r} is not offered here: this server serves text (input_text, "
            "output_text) and, in user, system and developer messages, input_image.",
            "input",
        )
    if not isinstance(part.get(key), str):
        raise _error(f"{where}.{key} must be a string.", "input")
    return str(part[key])


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _error(f"{where}.{key} must be a non-empty string.", "input")
    return value


def _error(message: str, param: str) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)
