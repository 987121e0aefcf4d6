"""Fixtures shared by the fake-engine server tests (registered in conftest.py via pytest_plugins):
a tokenizer, a PEFT-shaped adapter folder, a running server with the fake engine, an openai client."""

from __future__ import annotations

import openai
import pytest

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from loraserve.sampling_params import SamplingParams
from support.fake_engine import FakeEngine, write_adapter
from support.harness import RunningServer


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_adapter(str(tmp_path_factory.mktemp("adapters") / "sql"))


@pytest.fixture(scope="module")
def server(tokenizer, adapter_dir: str):
    engine = FakeEngine(tokenizer)
    options = ServerOptions(
        served_model_names=["base", "base-alias"], lora_modules=[LoRAModulePath("sql", adapter_dir)]
    )
    with RunningServer(engine, options) as running:
        yield running


@pytest.fixture()
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_ids(
    server: RunningServer, prompt_ids: list[int], max_tokens: int, lora_id: int = 0, index: int = 0
):
    return server.engine.expected_token_ids(
        prompt_ids, SamplingParams(max_tokens=max_tokens), lora_id, index
    )


def sql_id(server: RunningServer) -> int:
    return server.app.state.models.lora_requests["sql"].lora_id
