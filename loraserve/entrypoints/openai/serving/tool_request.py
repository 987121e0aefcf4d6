"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls` -> a `ToolPlan`, as vLLM reads them.

- `tool_choice` defaults to "auto" when tools are given; "auto" needs the server's
  --enable-auto-tool-choice and --tool-call-parser (vLLM's 400 otherwise) and reads the output with
  that parser; "none" passes the tools to the template (unless --exclude-tools-when-tool-choice-none)
  and reads nothing; "required" and a named function are written under a grammar through the
  structured-output path: "required" a JSON array of `{"name": <one of the tools>, "parameters":
  <its schema>}` (at least one; at most one with parallel_tool_calls=false), a named function its
  arguments object alone (vLLM's schemas).
- Earlier assistant `tool_calls` go back to the template with their arguments as objects (what
  transformers' templates read, as vLLM passes them); a tool result keeps its `tool_call_id`.
Every refusal is a 400 with vLLM's text where vLLM has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    ChatMessage,
)
from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from loraserve.entrypoints.openai.tool_parsers.declared_calls import DeclaredCalls
from loraserve.entrypoints.openai.tool_parsers.forced_tool_parsers import NamedToolParser, RequiredToolParser
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager
from loraserve.json_limits import JSONDepthError, check_json_depth
from loraserve.structured_output.params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
BOTH_CONSTRAINTS = "You can only either use constraints for structured outputs or tools, not both."
BEAM_WITH_FORCED_TOOLS = (
    'tool_choice "required" or a named function cannot be used with use_beam_search (beams take no grammar).'
)


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's tool flags (vLLM's FrontendArgs)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def parser_class(self) -> type[ToolParser] | None:
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            return None
        return ToolParserManager.get_tool_parser(self.tool_call_parser)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict[str, Any]] | None = None  # what the chat template gets as `tools`
    parser_class: type[ToolParser] | None = None  # "auto"
    named: str | None = None  # "named": the function
    structured: StructuredOutputsParams | None = None  # "required" / "named": the grammar
    max_calls: int | None = None  # parallel_tool_calls=false: 1
    declared: frozenset[str] = frozenset()  # "auto": the tools' names; calls to others are dropped

    def parser(self, tokenizer: Any) -> ToolParser | None:
        """A new parser for one choice's output; None when the output is not read for calls."""
        if self.mode == "auto" and self.parser_class is not None:
            return DeclaredCalls(self.parser_class(tokenizer), self.declared)
        if self.mode == "required":
            return RequiredToolParser(tokenizer)
        if self.mode == "named" and self.named is not None:
            return NamedToolParser(self.named, tokenizer)
        return None

    @property
    def skip_special_tokens(self) -> bool:
        return self.parser_class is None or self.parser_class.skip_special_tokens


NO_TOOLS = ToolPlan("none")


def tool_plan(request: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """The request's plan; APIError 400 with vLLM's texts for a tool_choice that cannot be served."""
    choice, tools = request.tool_choice, request.tools
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        shown = None if settings.exclude_tools_when_tool_choice_none else template_tools(tools)
        return ToolPlan("none", shown)
    if tools is None:
        raise _error("When using `tool_choice`, `tools` must be set.")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise _error(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
            "are supported."
        )
    if choice == "required" and not tools:  # OpenAI's: behaves as "none"
        return NO_TOOLS
    max_calls = None if request.parallel_tool_calls is not False else 1
    if isinstance(choice, dict):
        name = _named(choice, tools)
        params = next(t.function.parameters for t in tools if t.function.name == name)
        schema = params or {"type": "object", "properties": {}}
        return ToolPlan("named", template_tools(tools), None, name, _json(schema), max_calls)
    if choice == "required":
        return ToolPlan(
            "required", template_tools(tools), None, None, _json(required_schema(tools, max_calls)), max_calls
        )
    parser_class = settings.parser_class()
    if parser_class is None:
        raise _error(AUTO_NEEDS_FLAGS)
    declared = frozenset(tool.function.name for tool in tools)
    return ToolPlan("auto", template_tools(tools), parser_class, max_calls=max_calls, declared=declared)


def _named(choice: dict[str, Any], tools: list[ChatCompletionToolsParam]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _error(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}")
    if "name" not in function:
        raise _error(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise _error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}")
    if all(tool.function.name != name for tool in tools):
        raise _error("The tool specified in `tool_choice` does not match any of the specified `tools`")
    return name


def required_schema(tools: list[ChatCompletionToolsParam], max_calls: int | None) -> dict[str, Any]:
    """vLLM's schema for "required": an array of calls, each one of the tools with its own parameters
    (a tool without parameters takes `{}`); the tools' `$defs` merged at the top."""

    def one(tool: ChatCompletionToolsParam) -> dict[str, Any]:
        params = dict(tool.function.parameters or {"type": "object", "properties": {}})
        params.pop("$defs", None)
        return {
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
            "required": ["name", "parameters"],
        }

    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [one(t) for t in tools]},
    }
    if max_calls is not None:
        schema["maxItems"] = max_calls
    defs: dict[str, Any] = {}
    for tool in tools:
        for key, value in ((tool.function.parameters or {}).get("$defs") or {}).items():
            if key in defs and defs[key] != value:
                raise _error(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.", "tools"
                )
            defs[key] = value
    if defs:
        schema["$defs"] = defs
    return schema


def template_tools(tools: list[ChatCompletionToolsParam] | None) -> list[dict[str, Any]] | None:
    """The tools as transformers' `apply_chat_template(tools=...)` takes them (unset fields left out)."""
    return None if tools is None else [tool.model_dump(exclude_none=True) for tool in tools]


def template_message(message: ChatMessage, index: int, content: str) -> dict[str, Any]:
    """One message for the template, with its tool fields; 400 for a tool call that is not one."""
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        rendered["tool_calls"] = [_past_call(call, index, j) for j, call in enumerate(message.tool_calls)]
    return rendered


def _past_call(call: dict[str, Any], index: int, j: int) -> dict[str, Any]:
    where = f"messages[{index}].tool_calls[{j}]"
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _error(f"{where} needs a function with a name.", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            # strict=False: the arguments a grammar wrote may hold raw control characters in strings
            # (xgrammar's JSON string rule admits them), and a client sends them back as they were.
            check_json_depth(arguments, f"{where}.function.arguments")
            arguments = json.loads(arguments, strict=False) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise _error(f"{where}.function.arguments is not valid JSON: {exc}", "messages") from exc
        except JSONDepthError as exc:
            raise _error(str(exc), "messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _json(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, param="tools")  # the tools' schemas are the grammar


def _error(message: str, param: str = "tool_choice") -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)
