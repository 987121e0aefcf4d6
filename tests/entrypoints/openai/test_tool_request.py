"""tool_request: vLLM's schema for "required" (one of the tools, each with its own parameters,
`$defs` merged), at most one call with parallel_tool_calls=false, and earlier calls for the template."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import ChatCompletionRequest, ChatMessage
from loraserve.entrypoints.openai.serving.tool_request import (
    ToolSettings,
    template_message,
    tool_plan,
)

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/point"}},
                "$defs": {"point": POINT},
            },
        },
    },
    {"type": "function", "function": {"name": "stop"}},
]


def _plan(**fields: Any) -> Any:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    return tool_plan(request, ToolSettings())


def test_required_schema_takes_each_tool_and_nothing_else() -> None:
    plan = _plan(tools=TOOLS, tool_choice="required")
    schema = plan.structured.json
    assert plan.mode == "required" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"point": POINT}
    jsonschema.validate(
        [{"name": "move", "parameters": {"to": {"x": 1}}}, {"name": "stop", "parameters": {}}], schema
    )
    for wrong in (
        [],
        [{"name": "fly", "parameters": {}}],
        [{"name": "move", "parameters": {"to": {"x": "a"}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert (
        _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).structured.json["maxItems"] == 1
    )


def test_named_schema_is_the_functions_parameters() -> None:
    plan = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "stop"}})
    assert (plan.mode, plan.named, plan.structured.json) == (
        "named",
        "stop",
        {"type": "object", "properties": {}},
    )


def test_conflicting_defs_are_refused() -> None:
    other = {
        "type": "function",
        "function": {
            "name": "jump",
            "parameters": {"type": "object", "$defs": {"point": {"type": "string"}}},
        },
    }
    with pytest.raises(APIError, match="multiple schemas"):
        _plan(tools=[*TOOLS, other], tool_choice="required")


def test_earlier_calls_go_to_the_template_with_object_arguments() -> None:
    message = ChatMessage(
        role="assistant",
        content=None,
        tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "move", "arguments": '{"to": {"x": 1}}'}}
        ],
    )
    rendered = template_message(message, 1, "")
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"to": {"x": 1}}
    result = template_message(ChatMessage(role="tool", tool_call_id="c1", content="ok"), 2, "ok")
    assert result == {"role": "tool", "content": "ok", "tool_call_id": "c1"}
    with pytest.raises(APIError, match="needs a function with a name"):
        template_message(ChatMessage(role="assistant", tool_calls=[{"id": "c"}]), 1, "")
