"""A Responses request as the chat completion request that serves it, through the chat path.

`input` (a string, or items: messages with text parts, `function_call` and `function_call_output`)
becomes chat messages after the stored conversation of `previous_response_id`, `instructions` a
system message first (never carried over from a previous response, as OpenAI's), function `tools`
chat's tools, `tool_choice` chat's (a named function `{"type": "function", "name": ...}`),
`text.format` chat's `response_format`. The chat path then renders, tokenizes, plans the tools
(parsers, grammars) and builds the sampling params exactly as for /v1/chat/completions. What is
not offered (built-in tools, images and files, reasoning items) is a 400 naming it.
"""

from __future__ import annotations

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
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(the chat request, the conversation it continues: `history` and this input's messages,
    without the instructions)."""
    tools = function_tools(request.tools)
    choice = chat_tool_choice(request.tool_choice)
    conversation = [*history, *input_messages(request.input)]
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
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
        return ChatCompletionRequest.model_validate(fields), conversation
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise _error(f"{where}: {first.get('msg')}", _PARAMS.get(where.split(".")[0], "input")) from exc


def responses_param(param: str | None) -> str | None:
    """A chat parameter's name as the Responses API calls it."""
    return None if param is None else _PARAMS.get(param, param)


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
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        where = f"input[{i}]"
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
                "(text), function_call and function_call_output.",
                "input",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _error(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}.", "input")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


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
    """A string, or text parts joined; other parts (images, files, audio) are a 400 naming them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"{where} must be a string or a list of content parts.", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(str(kind))
        if key is None:
            raise _error(
                f"{where}[{j}]: content of type {kind!r} is not offered: this server serves text "
                "(input_text, output_text).",
                "input",
            )
        if not isinstance(part.get(key), str):
            raise _error(f"{where}[{j}].{key} must be a string.", "input")
        texts.append(part[key])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _error(f"{where}.{key} must be a non-empty string.", "input")
    return value


def _error(message: str, param: str) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)
