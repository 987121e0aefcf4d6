"""vLLM's fields that need the real engine (tiny Llama, a PEFT adapter, prefix caching on), checked
against PEFT: prompt_logprobs over HTTP, echo with logprobs, a cached prompt still getting every
prompt logprob, usage.prompt_tokens_details.cached_tokens, -1 logprob counts, and vLLM's metrics."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

BLOCK = 8
TOL = 2e-3
MODELS = {"tiny": None, "sql": "sql"}  # served name -> PEFT adapter


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("vllm-fields") / "sql")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapter(base, adapter, 77, model_dir, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    oracle = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter, adapter_name="sql"
    ).eval()
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=96,
            block_size=BLOCK,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=16 << 20,
        )
    )
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath("sql", adapter)],
        frontend=FrontendOptions(enable_prompt_tokens_details=True),
    )
    with RunningServer(engine, options) as server:
        yield server, oracle, engine.engine.model_config.vocab_size


def _reference(oracle: Any, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """PEFT's log-softmax at every position of `ids`."""
    with torch.no_grad():
        if adapter is None:
            with oracle.disable_adapter():
                logits = oracle(torch.tensor([ids])).logits[0]
        else:
            oracle.set_adapter(adapter)
            logits = oracle(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def _check_prompt_logprobs(
    reference: torch.Tensor, prompt: list[int], entries: list[Any], num_top: int
) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry = entries[i]
        assert str(prompt[i]) in entry, f"position {i} lacks its own token"
        assert abs(entry[str(prompt[i])]["logprob"] - reference[i - 1, prompt[i]].item()) < TOL
        ranked = sorted((v["rank"], int(k)) for k, v in entry.items())
        assert len(entry) <= num_top + 1
        for rank, token in ranked[:num_top]:
            assert abs(reference[i - 1, token].item() - reference[i - 1].topk(rank).values[-1].item()) < TOL


def _prompt(seed: int, length: int = 29) -> list[int]:
    return [6 + (seed * 31 + i * 7) % 200 for i in range(length)]


@pytest.mark.parametrize("model", list(MODELS))
def test_prompt_logprobs_over_http(stack: Any, model: str) -> None:
    server, oracle, _ = stack
    prompt = _prompt(1 + len(model))
    reference = _reference(oracle, MODELS[model], prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
    reply = server.http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    _check_prompt_logprobs(reference, prompt, reply.json()["choices"][0]["prompt_logprobs"], 2)
    chat_prompt_len = None
    chat = server.http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
    ).json()
    chat_prompt_len = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == chat_prompt_len and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # its own token only


@pytest.mark.parametrize("model", list(MODELS))
def test_a_cached_prompt_still_gets_every_prompt_logprob(stack: Any, model: str) -> None:
    server, oracle, _ = stack
    prompt = _prompt(10 + len(model))
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = server.http.post("/v1/completions", json=body).json()
    # Nothing cached yet: current vLLM still reports the details, with 0.
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = server.http.post("/v1/completions", json=body).json()
    cached = (len(prompt) - 1) // BLOCK * BLOCK  # whole blocks, the last token always computed
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    with_logprobs = server.http.post("/v1/completions", json={**body, "prompt_logprobs": 1}).json()
    reference = _reference(oracle, MODELS[model], prompt)
    _check_prompt_logprobs(reference, prompt, with_logprobs["choices"][0]["prompt_logprobs"], 1)
    assert with_logprobs["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }  # it computed its whole prompt
    assert with_logprobs["choices"][0]["text"] == second["choices"][0]["text"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chat = [{"role": "user", "content": "the same question, asked twice over"}]
    client.chat.completions.create(model=model, messages=chat, max_tokens=1)
    again = client.chat.completions.create(model=model, messages=chat, max_tokens=1)
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("model", list(MODELS))
def test_echo_with_logprobs_covers_the_prompt(stack: Any, model: str) -> None:
    server, oracle, _ = stack
    prompt = _prompt(20 + len(model), 12)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=3,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    assert tokens[: len(prompt)] == prompt and len(tokens) == len(prompt) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = _reference(oracle, MODELS[model], tokens)
    for i in range(1, len(tokens)):
        assert abs(logprobs.token_logprobs[i] - reference[i - 1, tokens[i]].item()) < TOL
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # max_tokens 0: the prompt's logprobs alone (lm-eval's loglikelihood form).
    only = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=0,
        echo=True,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    scored = only.choices[0].logprobs
    assert [int(t.removeprefix("token_id:")) for t in scored.tokens] == prompt
    assert scored.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1 : len(prompt)], abs=1e-5)


def test_minus_one_is_the_whole_vocabulary(stack: Any) -> None:
    server, _, vocab = stack
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    cases = [
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}, "sample"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1, "logprobs": -1}, "sample"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "max_tokens": 1, "prompt_logprobs": -1},
            "prompt",
        ),
    ]
    for path, body, kind in cases:  # vLLM's text: -1 is vocab_size, above the default max_logprobs (20)
        reply = server.http.post(path, json=body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"] == (
            f"Requested {kind} logprobs of {vocab}, which is greater than max allowed: 20"
        )


def _samples(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = server.http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items())))
    return samples.get(key, 0.0)


def test_vllm_metrics_count_what_was_served(stack: Any) -> None:
    server, _, _ = stack
    before = _samples(server)
    prompts = [_prompt(40 + i, 10 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        model = "sql" if i % 2 else "tiny"
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": i == 2}
        assert server.http.post("/v1/completions", json=body).status_code == 200
    after = _samples(server)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == 3
    assert grew("vllm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert grew("vllm:generation_tokens_total") == 12
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time", "request_inference_time"):  # fmt: skip
        assert grew(f"vllm:{histogram}_seconds_count") == 3, histogram
    assert grew("vllm:request_prompt_tokens_sum") == sum(len(p) for p in prompts)
    assert grew("vllm:request_generation_tokens_sum") == 12
    assert grew("vllm:request_params_max_tokens_sum") == 12 and grew("vllm:request_params_n_count") == 3
    assert 0 < grew("vllm:inter_token_latency_seconds_count") <= 9
    assert grew("vllm:inter_token_latency_seconds_count") == grew("vllm:time_per_output_token_seconds_count")
    assert grew("vllm:prefix_cache_queries_total") >= sum(len(p) for p in prompts)
    assert _value(after, "vllm:prefix_cache_hits_total") <= _value(after, "vllm:prefix_cache_queries_total")
    assert _value(after, "vllm:num_requests_running") == 0 and _value(after, "vllm:num_requests_waiting") == 0
    assert 0.0 <= _value(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert ("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "tiny"))) in after
    # Tokens per engine step (vLLM's histogram): one after the other, each request is a prefill step
    # of its whole (uncached) prompt and three decode steps of one token.
    assert grew("vllm:iteration_tokens_total_count") == 3 * 4
    assert grew("vllm:iteration_tokens_total_sum") == sum(len(p) for p in prompts) + 3 * 3
    buckets = {
        labels: v for (name, labels), v in after.items() if name == "vllm:iteration_tokens_total_bucket"
    }
    bounds = sorted((float(dict(labels)["le"]), v) for labels, v in buckets.items())
    assert [b for b, _ in bounds] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, float("inf")]
    assert all(a[1] <= b[1] for a, b in zip(bounds, bounds[1:])) and bounds[-1][1] == _value(
        after, "vllm:iteration_tokens_total_count"
    )
    info = [
        dict(labels) for (name, labels), v in after.items() if name == "vllm:cache_config_info" and v == 1
    ]
    assert info == [
        {
            "block_size": str(BLOCK),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "kv_cache_memory_bytes": str(16 << 20),
            "num_gpu_blocks": info[0]["num_gpu_blocks"],
            "num_cpu_blocks": "None",
            "engine": "0",
        }
    ]
    assert int(info[0]["num_gpu_blocks"]) > 0


@pytest.mark.parametrize("model", list(MODELS))
def test_cache_salt_separates_prefix_caches(stack: Any, model: str) -> None:
    server, _, _ = stack
    prompt = _prompt(60 + len(model))
    cached = (len(prompt) - 1) // BLOCK * BLOCK

    def details(**extra: Any) -> Any:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, **extra}
        reply = server.http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]

    none = {"cached_tokens": 0}
    assert details(cache_salt="tenant-a") == none
    assert details(cache_salt="tenant-a") == {"cached_tokens": cached}  # the same salt shares blocks
    assert details(cache_salt="tenant-b") == none  # another salt does not
    assert details() == none  # nor a request without one
    assert details() == {"cached_tokens": cached}
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "salted question here"}],
        "max_tokens": 1,
    }
    first = server.http.post("/v1/chat/completions", json={**chat, "cache_salt": "s"}).json()["usage"]
    second = server.http.post("/v1/chat/completions", json={**chat, "cache_salt": "s"}).json()["usage"]
    assert first["prompt_tokens_details"] == none and second["prompt_tokens_details"]["cached_tokens"] > 0
