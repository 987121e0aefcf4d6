"""Versioned adapter names on a live server with the real engine, through the OpenAI client:
name@label and name@digest address one version while the plain name serves the newest; /v1/models
lists versions; an RL-style rollout reloads one name (same folder, new files) every step while
requests stream, each finishing on the version it was admitted with, and the held versions stay two.

Oracle: the offline API (`LLM`) on each version's own files, pinned to the digest the server listed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions

PROMPT = list(range(10, 42))
STEPS = 5
MAX_TOKENS = 12
ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, enable_lora=True, max_loras=3, max_cpu_loras=8,
              max_lora_rank=8)  # fmt: skip


@pytest.fixture(scope="module")
def steps(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One adapter folder per training step, all of one shape."""
    from loraserve.demo.random_model import save_peft_adapter

    root = tmp_path_factory.mktemp("rollout")
    folders = [root / f"step{i}" for i in range(STEPS)]
    for i, folder in enumerate(folders):
        save_peft_adapter(hf_model(tiny_model("llama")), str(folder), 300 + i, tiny_model("llama"), r=8,
                          lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"])  # fmt: skip
    return folders


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Any:
    from loraserve.entrypoints.llm import LLM

    return LLM(tiny_model("llama"), **ENGINE)


@pytest.fixture(scope="module")
def oracle(llm: Any, steps: list[Path]) -> dict[int, tuple[str, str]]:
    """step -> (content digest, greedy text), from the offline API, each run pinned to its digest."""
    from loraserve.lora.request import LoRARequest
    from loraserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for i, folder in enumerate(steps):
        lora = LoRARequest(f"step{i}", i + 1, str(folder))
        digest = llm.lora_digest(lora)
        pinned = LoRARequest(f"step{i}", i + 1, str(folder), version=digest[:8])
        text = llm.generate([{"prompt_token_ids": PROMPT}], params, pinned, use_tqdm=False)[0].outputs[0].text
        out[i] = (digest, text)
    assert len({text for _, text in out.values()}) == STEPS  # each version's output tells it apart
    return out


def test_the_offline_api_refuses_another_version(llm: Any, steps: list[Path], oracle: dict) -> None:
    from loraserve.errors import LoRAAdapterVersionError
    from loraserve.lora.request import LoRARequest, version_key
    from loraserve.sampling_params import SamplingParams

    wrong = LoRARequest("step0", 1, str(steps[0]), version=oracle[1][0][:10])
    with pytest.raises(LoRAAdapterVersionError, match=r"The model `step0@.*` does not exist"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2), wrong, use_tqdm=False)
    resident = llm.engine.lora_version_residency()
    assert version_key("step0", oracle[0][0]) in resident and "step0" not in resident


@pytest.fixture()
def server(tiny_model: Any):
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), **ENGINE))
    options = ServerOptions(served_model_names=["tiny"], allow_runtime_lora_updating=True)
    with RunningServer(engine, options) as running:
        yield running


def load(server: RunningServer, path: Path, **extra: Any) -> None:
    body = {"lora_name": "policy", "lora_path": str(path), **extra}
    response = server.http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 200, response.text


def text_of(client: openai.OpenAI, model: str, **extra: Any) -> str:
    completion = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )
    return completion.choices[0].text


def test_versions_through_the_openai_client(
    server: RunningServer, steps: list[Path], oracle: dict[int, tuple[str, str]]
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    (d0, t0), (d1, t1) = oracle[0], oracle[1]
    load(server, steps[0], version="v1")
    load(server, steps[1], load_inplace=True, version="v2")
    assert text_of(client, "policy") == text_of(client, "policy@v2") == t1  # the plain name: the newest
    assert text_of(client, "policy@v1") == text_of(client, f"policy@{d0[:8]}") == t0
    # A version in a mix list, and in the "name=weight" spelling of `model`.
    assert text_of(client, "tiny", adapters=[{"name": "policy@v1", "weight": 1.0}]) == t0
    assert text_of(client, "policy@v1=1.0") == t0
    cards = {model.id: model for model in client.models.list().data}
    assert cards["policy"].model_extra["digest"] == d1 and cards["policy"].model_extra["version"] == "v2"
    old = cards[f"policy@{d0[:12]}"]
    assert old.model_extra["digest"] == d0 and old.model_extra["parent"] == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        text_of(client, "policy@v9")
    message = missing.value.body["message"]
    assert message.startswith("The model `policy@v9` does not exist") and d1[:12] in message
    with pytest.raises(openai.NotFoundError):
        text_of(client, f"policy@{'0' * 12}")
    # A third version retires the first: it is no longer addressable.
    load(server, steps[2], load_inplace=True)
    with pytest.raises(openai.NotFoundError):
        text_of(client, "policy@v1")
    assert text_of(client, "policy@v2") == t1 and text_of(client, "policy") == oracle[2][1]


def stream_first_chunk(server: RunningServer) -> tuple[Any, Any, str]:
    """Start a streaming completion of "policy" and read until its first token is out (it is running)."""
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    context = httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60)
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            return context, lines, json.loads(line[6:])["choices"][0]["text"]
    raise AssertionError("the stream ended before its first token")


def finish(context: Any, lines: Any, text: str) -> str:
    for line in lines:
        if line.startswith("data: {"):
            text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
    context.__exit__(None, None, None)
    return text


def test_rollout_reloads_every_step_without_stale_weights_or_growth(
    server: RunningServer, steps: list[Path], oracle: dict[int, tuple[str, str]], tmp_path: Path
) -> None:
    live = tmp_path / "policy"  # the trainer writes each step's weights over the same folder
    shutil.copytree(steps[0], live)
    load(server, live)
    for step in range(1, STEPS):
        running = stream_first_chunk(server)  # admitted on step - 1
        shutil.rmtree(live)
        shutil.copytree(steps[step], live)
        load(server, live, load_inplace=True)
        assert finish(*running) == oracle[step - 1][1]  # finished on the weights it started with
        cards = {c["id"]: c for c in server.http.get("/v1/models").json()["data"]}
        assert cards["policy"]["digest"] == oracle[step][0]  # the new content, not the folder's old one
        assert server.http.post("/v1/completions", json={
            "model": "policy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] == oracle[step][1]  # same prompt: no KV of the old version reused  # fmt: skip
        versions = [c for c in cards if c == "policy" or c.startswith("policy@")]
        assert len(versions) == 2, versions  # the newest and the previous one, however many steps
    engine = server.engine

    def registered() -> int:
        return len(server.call(engine.list_loras))

    wait_for(lambda: registered() == 2, what="the retired versions to be removed from the engine")
