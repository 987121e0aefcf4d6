"""Engine vs transformers: greedy tokens equal `generate`, prompt logprobs match, batching changes nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.errors import PromptTooLongError

ARCHS = ["llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox"]
NUM_NEW = 10


def _prompts(vocab_size: int, lengths: tuple[int, ...] = (3, 17, 9, 30), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf: Any, prompt: list[int], num_new: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(
    arch: str, tiny_model: Any, hf_model: Any, linear_backend: str
) -> None:
    path = tiny_model(arch)
    hf = hf_model(path)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, NUM_NEW)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            ours = out.prompt_logprobs[pos][prompt[pos]].logprob
            assert math.isclose(ours, ref[pos - 1, prompt[pos]].item(), abs_tol=1e-4)


@pytest.fixture(scope="module")
def llama_path(tiny_model: Any) -> str:
    return tiny_model("llama")


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, min_p=0.05, seed=11, max_tokens=12, ignore_eos=True),
    ]


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_one_at_a_time_with_chunking_and_preemption(
    llama_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = _prompts(512, lengths=(5, 40, 23, 3, 61))
    params = _mixed_params()
    llm = LLM(llama_path, dtype="float32")
    alone = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert _run(llm, prompts, params) == alone
    chunked = LLM(llama_path, dtype="float32", max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _run(chunked, prompts, params) == alone
    # 12 blocks of 8 tokens: 96 slots for five sequences needing 192 in all forces preemption.
    tight = LLM(
        llama_path,
        dtype="float32",
        block_size=8,
        num_kv_blocks=12,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    with caplog.at_level("WARNING", logger="loraserve.engine.kv_budget"):
        assert _run(tight, prompts, params) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    # the user hears of it once (rate-limited), with the blocks and the running count
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert (
        len(warnings) == 1
        and "12 blocks" in warnings[0]
        and "total_num_cumulative_preemption=" in warnings[0]
    )


def test_prefix_cache_hits_change_nothing(llama_path: str) -> None:
    llm = LLM(llama_path, dtype="float32", block_size=4)
    prompt = _prompts(512, lengths=(37,))[0]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    first = _run(llm, [prompt], params)
    hits_before = llm.engine.block_manager.num_prefix_hits
    second = _run(llm, [prompt], params)
    assert llm.engine.block_manager.num_prefix_hits > hits_before
    assert first == second
    # A shared prefix with a different tail reuses blocks and still matches an uncached engine.
    other = prompt[:20] + _prompts(512, lengths=(9,), seed=5)[0]
    fresh = LLM(llama_path, dtype="float32", block_size=4, enable_prefix_caching=False)
    assert _run(llm, [other], params) == _run(fresh, [other], params)


def test_n_and_stop_and_text(llama_path: str) -> None:
    llm = LLM(llama_path, dtype="float32")
    out = llm.generate(
        "The quick brown fox",
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    tokenizer = llm.get_tokenizer()
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    greedy = llm.generate(
        "SELECT name", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop_token = greedy.token_ids[2]
    stopped = llm.generate(
        "SELECT name",
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_token
    assert stopped.outputs[0].token_ids == greedy.token_ids[: greedy.token_ids.index(stop_token) + 1]


def test_bad_prompts_fail_alone(llama_path: str) -> None:
    llm = LLM(llama_path, dtype="float32", max_model_len=64)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [5, -1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    ok = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(ok[0].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


def test_chat_template(llama_path: str) -> None:
    llm = LLM(llama_path, dtype="float32")
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.get_tokenizer().encode(expected)


def test_chat_passes_tools_and_kwargs_to_the_template(llama_path: str) -> None:
    llm = LLM(llama_path, dtype="float32")
    messages = [{"role": "user", "content": "hello"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ flavour }}{{ messages[0].content }}"
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = llm.chat(
        messages,
        params,
        use_tqdm=False,
        chat_template=template,
        tools=tools,
        chat_template_kwargs={"flavour": "<x>"},
    )[0]
    expected = llm.get_tokenizer().apply_chat_template(
        messages, chat_template=template, tools=tools, flavour="<x>", tokenize=False
    )
    assert expected.startswith("[get_weather]<x>")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(expected)


def test_prompt_logprobs_survive_preemption(llama_path: str) -> None:
    prompts = _prompts(512, lengths=(20, 30, 9, 17))  # 12 blocks at admission, 22 by the end
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    ref = LLM(llama_path, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    tight = LLM(
        llama_path,
        dtype="float32",
        block_size=8,
        num_kv_blocks=12,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for prompt, a, b in zip(prompts, ref, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            assert math.isclose(
                b.prompt_logprobs[pos][prompt[pos]].logprob,
                a.prompt_logprobs[pos][prompt[pos]].logprob,
                abs_tol=1e-5,
            )


def test_generation_config_eos_ids_stop(llama_path: str, tmp_path: Any) -> None:
    import json
    import shutil

    params = SamplingParams(temperature=0.0, max_tokens=8)
    greedy = LLM(llama_path, dtype="float32").generate("SELECT name", params, use_tqdm=False)[0].outputs[0]
    eot = greedy.token_ids[3]
    model = shutil.copytree(llama_path, str(tmp_path / "model"))
    with open(f"{model}/generation_config.json", "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": [2, eot]}, f)
    out = LLM(model, dtype="float32").generate("SELECT name", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(eot) + 1]


def test_stream_never_shows_a_partial_stop_string(llama_path: str) -> None:
    llm = LLM(llama_path, dtype="float32")
    free = (
        llm.generate(
            "The quick", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = free[4:9]
    assert len(stop) == 5
    engine = llm.engine
    engine.add_request(
        "s", "The quick", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    )
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts[-1] == free[: free.index(stop)]
    assert all(texts[-1].startswith(t) for t in texts)  # streamed text only ever grows to the final
