"""Tool-call parsers (`--tool-call-parser NAME`): how a model family writes calls in its text, read
into OpenAI's `tool_calls`, whole or as a stream. Importing the package registers the built-in ones
(hermes, llama3_json, mistral, pythonic); a `--tool-parser-plugin` file registers more."""

from __future__ import annotations

from loraserve.entrypoints.openai.tool_parsers import (  # noqa: F401  (they register themselves)
    hermes_tool_parser,
    llama_tool_parser,
    mistral_tool_parser,
    pythonic_tool_parser,
)
from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedOutput,
    PartialToolCall,
    ToolCall,
    ToolParser,
)
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager
from loraserve.entrypoints.openai.tool_parsers.streaming import StreamDelta, ToolCallDelta, ToolCallStream

__all__ = [
    "ExtractedToolCalls",
    "ParsedOutput",
    "PartialToolCall",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolParserManager",
]
