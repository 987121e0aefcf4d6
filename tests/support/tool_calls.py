"""What the tool-calling server tests (test_server_tool_calls.py) send and how they read the answers.

The tools and their schemas, a chat template that shows the tools, earlier calls and tool results, each
built-in parser's format as a regex that forces it, the requests the server must refuse with vLLM's
texts; the server (tiny model, one adapter, that template) and an OpenAI-client chat call that reads
one choice, accumulating a stream as the client's users do and checking its delta format on the way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from support.harness import RunningServer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# A template that shows what it gets: the tools, earlier calls (arguments as objects) and tool results.
TEMPLATE = (
    "{% if tools %}<|system|>TOOLS={% for t in tools %}{{ t['type'] }}:{{ t['function']['name'] }} {% endfor %}"
    "</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}]{% endif %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}CALL {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What each parser's format looks like, forced by a regex: (regex, content before the calls).
FORMATS = {
    "hermes": (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "unit": "c", '
        r'"days": [1-7]\}\}</tool_call><tool_call>\{"name": "get_time", "arguments": \{"zone": "utc"\}\}'
        r"</tool_call>",
        "Sure. ",
    ),
    "llama3_json": (
        r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "[a-z]{1,5}", "unit": "f", '
        r'"days": [1-7]\}\}; \{"name": "get_time", "parameters": \{"zone": "cet"\}\}',
        None,
    ),
    "mistral": (
        r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "unit": "c", '
        r'"days": [1-7]\}\}, \{"name": "get_time", "arguments": \{"zone": "utc"\}\}\]',
        None,
    ),
    "pythonic": (
        r'\[get_weather\(city="[a-z]{1,5}", unit="f", days=[1-7]\), get_time\(zone="cet"\)\]',
        None,
    ),
}


def tools_engine(model_dir: str) -> Any:
    """The real engine on `model_dir` (float32, LoRA, xgrammar without free whitespace)."""
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=256,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=32 << 20,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
    )


def serve_with_tools(model_and_adapter: tuple[str, str], **frontend: Any) -> Iterator[RunningServer]:
    """A live server of the model as "tiny" and the adapter as "sql", with TEMPLATE and `frontend`."""
    model_dir, adapter = model_and_adapter
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath("sql", adapter)],
        frontend=FrontendOptions(chat_template=TEMPLATE, **frontend),
    )
    with RunningServer(tools_engine(model_dir), options) as running:
        yield running


def openai_client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


async def chat_choice(client: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """One choice as {content, tool_calls: [{id, name, arguments}], finish_reason}; a stream is
    accumulated as the OpenAI client's users do, checking the delta format on the way."""
    kwargs.setdefault("messages", MESSAGES)
    result = await client.chat.completions.create(stream=stream, **kwargs)
    if not stream:
        choice = result.choices[0]
        calls = [
            {"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        return {"content": choice.message.content, "tool_calls": calls, "finish_reason": choice.finish_reason}
    content, calls, reason = None, [], None
    async for chunk in result:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index == len(calls):  # a call's first delta: id, type, name, arguments ""
                    assert call.id and call.type == "function" and call.function.name, call
                    assert call.function.arguments == "", call
                    calls.append(
                        {"id": call.id, "type": call.type, "name": call.function.name, "arguments": ""}
                    )
                else:
                    assert call.id is None and call.function.name is None, call
                    calls[call.index]["arguments"] += call.function.arguments
            reason = choice.finish_reason or reason
    return {"content": content, "tool_calls": calls, "finish_reason": reason}


def loose_json(text: str) -> Any:
    return json.loads(text, strict=False)  # raw control characters: see abstract_tool_parser.is_json_object


def check_calls(result: dict[str, Any], names: set[str], at_most: int | None = None) -> None:
    """Only tool calls (at most `at_most`) of the tools `names`, with vLLM's ids and valid arguments."""
    calls = result["tool_calls"]
    assert calls and result["finish_reason"] == "tool_calls" and result["content"] is None, result
    assert at_most is None or len(calls) <= at_most, result
    for call in calls:
        assert call["type"] == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call["id"]), call
        assert call["name"] in names, call
        jsonschema.validate(loose_json(call["arguments"]), SCHEMAS[call["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def rendered_prompt(server: RunningServer, body: dict[str, Any]) -> str:
    """The prompt the chat template renders for `body` (through /tokenize and /detokenize)."""
    reply = server.http.post("/tokenize", json={"model": "tiny", **body})
    assert reply.status_code == 200, reply.text
    return server.http.post("/detokenize", json={"model": "tiny", "tokens": reply.json()["tokens"]}).json()[
        "prompt"
    ]


def prompt_tokens(server: RunningServer, **fields: Any) -> int:
    """The prompt length of a one-token chat completion of MESSAGES with `fields`."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **fields}
    reply = server.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


# Requests the server refuses (400): (fields, a part of vLLM's message, the error's param or None).
BAD_TOOL_REQUESTS: list[tuple[dict[str, Any], str, str | None]] = [
    (
        {"tools": TOOLS, "tool_choice": "auto"},
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        "tool_choice",
    ),
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice', "tool_choice"),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "When using `tool_choice`, `tools` must be set.",
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": "always"},
        'Invalid value for `tool_choice`: always! Only named tools, "none", "auto" or "required" are supported.',
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
        "The tool specified in `tool_choice` does not match any of the specified `tools`",
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function"}},
        "Invalid value for `function`: `None` in `tool_choice`!",
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "Expected field `name` in `function` in `tool_choice`!",
        "tool_choice",
    ),
    (
        {"tools": [{"type": "function", "function": {"parameters": TIME}}], "tool_choice": "none"},
        "tools.0.function.name: Field required",
        "tools.0.function.name",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tool_choice": "required",
        },
        "must be a JSON Schema of type 'object'",
        "tools.0.function.parameters",
    ),
    (
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "none"},
        "tools.0.type",
        "tools.0.type",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "You can only either use constraints for structured outputs or tools, not both.",
        "tool_choice",
    ),
    (  # the grammar path's own refusal, as for response_format
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"n": {"type": "integer", "multipleOf": 3}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "The provided JSON schema contains features not supported by xgrammar.",
        None,
    ),
    (
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments is not valid JSON",
        "messages",
    ),
]
