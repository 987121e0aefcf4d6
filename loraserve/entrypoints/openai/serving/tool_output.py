"""A choice's output read for tool calls: the response message (content null when only calls) and the
stream's deltas in OpenAI's format; finish_reason "tool_calls" when calls were made and the model
stopped (a call cut short by max_tokens keeps "length")."""

from __future__ import annotations

from loraserve.entrypoints.openai.serving.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from loraserve.entrypoints.openai.tool_parsers.streaming import StreamDelta, ToolCallStream


def response_message(
    parser: ToolParser | None, max_calls: int | None, role: str, text: str, echo: str
) -> tuple[ChatResponseMessage, bool]:
    """(the message, whether it carries calls)."""
    extracted = parser.extract_tool_calls(text) if parser is not None else None
    if extracted is None or not extracted.tools_called:
        return ChatResponseMessage(role=role, content=echo + text), False
    calls = extracted.calls if max_calls is None else extracted.calls[:max_calls]
    content = echo + (extracted.content or "")
    tool_calls = [ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls]
    return ChatResponseMessage(role=role, content=content or None, tool_calls=tool_calls), True


def finish_reason(reason: str | None, tools_called: bool) -> str | None:
    return "tool_calls" if tools_called and reason == "stop" else reason


def new_stream(parser: ToolParser, max_calls: int | None) -> ToolCallStream:
    return ToolCallStream(parser, lambda: random_id("chatcmpl-tool"), max_calls)


def delta_message(delta: StreamDelta) -> DeltaMessage:
    call = delta.tool_call
    if call is None:
        return DeltaMessage(content=delta.content)
    if call.name is not None:  # a call's first delta
        first = DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
        return DeltaMessage(tool_calls=[first])
    return DeltaMessage(
        tool_calls=[DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))]
    )
