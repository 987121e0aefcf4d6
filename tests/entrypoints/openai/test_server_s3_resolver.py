"""The S3 resolver behind a running server: an adapter that exists only in S3 (moto's real S3 endpoint)
serves requests through the OpenAI API exactly as the same adapter from a local folder does, and a
refused or unreachable store answers with the adapter error's status (400, 503), not a silent 404."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support.fake_engine import FakeEngine, write_adapter
from support.harness import RunningServer
from support.moto_s3 import FAKE_AWS_ENV, MotoS3, closed_port_url, moto_s3_server, upload_adapter

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry
from loraserve.lora.resolvers.s3_resolver import RESOLVER_NAME, register_s3_resolver

S3_ENV = ("PLUGINS", "LORA_RESOLVER_S3_BUCKET", "LORA_RESOLVER_S3_PREFIX", "LORA_RESOLVER_S3_ENDPOINT_URL",
          "LORA_RESOLVER_S3_CACHE_DIR", "LORA_RESOLVER_S3_CONNECT_TIMEOUT", "LORA_RESOLVER_S3_MAX_ATTEMPTS")


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in FAKE_AWS_ENV.items():
            mp.setenv(key, value)
        with moto_s3_server() as server:
            yield server


@pytest.fixture()
def s3_resolver(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[Any]:
    """register_s3_resolver() as the plugin loader calls it, from the environment `configure` sets."""
    for var in S3_ENV:
        monkeypatch.delenv("LORASERVE_" + var, raising=False)
        monkeypatch.delenv("VLLM_" + var, raising=False)
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})

    def configure(bucket: str, endpoint_url: str) -> LoRAResolver:
        monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_BUCKET", bucket)
        monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_PREFIX", "loras")
        monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_ENDPOINT_URL", endpoint_url)
        monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_CACHE_DIR", str(tmp_path / "s3-cache"))
        monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_CONNECT_TIMEOUT", "1")
        monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_MAX_ATTEMPTS", "2")
        register_s3_resolver()
        return LoRAResolverRegistry.get_resolver(RESOLVER_NAME)

    yield configure


def greedy_tokens(client: openai.OpenAI, model: str, prompt: list[int]) -> list[str]:
    result = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert result.model == model
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return list(logprobs.tokens)


def test_adapter_only_in_s3_is_served(s3: MotoS3, s3_resolver: Any, tiny_model: Any, hf_model: Any, tmp_path) -> None:
    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    local = str(tmp_path / "local-copy")
    save_peft_adapter(hf_model(model_dir), local, 11, model_dir, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    bucket = s3.new_bucket()
    upload_adapter(s3, bucket, "loras/team/from-s3", local, sums={})
    s3_resolver(bucket, s3.endpoint_url)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=model_dir, dtype="float32", device="cpu", max_model_len=64, enable_lora=True,
                   max_loras=2, max_cpu_loras=2, max_lora_rank=8, kv_cache_memory_bytes=8 << 20)
    )
    options = ServerOptions(
        served_model_names=["tiny"], lora_modules=[LoRAModulePath("local", local)], allow_runtime_lora_updating=True
    )
    with RunningServer(engine, options) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        prompt = [5, 17, 42, 99, 7]
        from_s3 = greedy_tokens(client, "team/from-s3", prompt)
        assert from_s3 == greedy_tokens(client, "local", prompt)  # the same weights, byte for byte
        base = greedy_tokens(client, "tiny", prompt)
        assert from_s3 != base  # the adapter really applies
        cards = {card.id for card in client.models.list().data}
        assert "team/from-s3" in cards
        missing = server.http.post("/v1/completions", json={"model": "team/absent", "prompt": "hi"})
        assert missing.status_code == 404


def completion(server: RunningServer, model: str) -> httpx.Response:
    return server.http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})


def test_statuses_through_the_server(s3: MotoS3, s3_resolver: Any, tokenizer, tmp_path) -> None:
    fake = write_adapter(str(tmp_path / "fake"))
    bucket = s3.new_bucket()
    upload_adapter(s3, bucket, "loras/ok", fake)
    upload_adapter(s3, bucket, "loras/tampered", fake, sums={"adapter_model.safetensors": "1" * 64})
    s3_resolver(bucket, s3.endpoint_url)
    options = ServerOptions(served_model_names=["base"], allow_runtime_lora_updating=True)
    with RunningServer(FakeEngine(tokenizer), options) as server:
        assert completion(server, "ok").status_code == 200
        refused = completion(server, "tampered")
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "'tampered'" in message and "adapter_model.safetensors" in message and "sha256" in message
        assert completion(server, "absent").status_code == 404
        assert completion(server, "../loras/ok").status_code == 404
    LoRAResolverRegistry.resolvers.clear()
    s3_resolver(bucket, closed_port_url())
    with RunningServer(FakeEngine(tokenizer), options) as server:
        down = completion(server, "ok")
        assert down.status_code == 503 and down.headers["Retry-After"] == "1"
        body = down.json()["error"]
        assert body["type"] == "ServiceUnavailableError" and "'ok'" in body["message"]
        assert "cannot be read now" in body["message"] and "127.0.0.1" not in body["message"]

