"""Speculative decoding with a draft model (a 1-layer random Llama sharing the tiny target's tokenizer),
its draft adapters, and the sampled distribution of both methods: a chi-square test over every
three-token output of a three-token vocabulary, against the target's exact probabilities."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
from support.speculative import both_ways, counters, repetitive, run, tokens
from test_speculative import ADAPTERS, OPTIONS

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import TINY_SHAPE, save_peft_adapter, save_random_model
from loraserve.engine.ngram_index import NgramIndex
from loraserve.lora.request import LoRARequest

CHI2_26_AT_1E3 = 54.05  # the chi-square distribution's 0.999 quantile at 26 degrees of freedom


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def draft(llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A smaller random model (one layer, other weights) with the target's tokenizer files."""
    from transformers import LlamaConfig

    path = str(tmp_path_factory.mktemp("draft"))
    vocab = LlamaConfig.from_pretrained(llama).vocab_size
    save_random_model(path, LlamaConfig(vocab_size=vocab, **{**TINY_SHAPE, "num_hidden_layers": 1}), seed=99)
    for name in os.listdir(llama):
        if name.startswith(("tokenizer", "special_tokens")) or name.endswith(".jinja"):
            shutil.copy(os.path.join(llama, name), path)
    return path


@pytest.fixture(scope="module")
def adapters(llama: str, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("draft-adapters")
    out = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        save_peft_adapter(hf_model(llama), str(root / name), seed=50 + i, base_name=llama, **kwargs)
        out[name] = LoRARequest(name, i + 1, str(root / name))
    return out


@pytest.fixture(scope="module")
def base(llama: str) -> LLM:
    return LLM(llama, **OPTIONS)


def test_a_draft_model_gives_the_same_outputs(llama: str, draft: str, base: LLM) -> None:
    prompts = repetitive(5, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, repetition_penalty=1.1),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=8, seed=4, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]  # fmt: skip
    spec = LLM(
        llama,
        **OPTIONS,
        speculative_config={"model": draft, "num_speculative_tokens": 3, "draft_policy": "always"},
    )
    expected, _ = run(base, prompts, params)
    got, counts = run(spec, prompts, params)
    assert tokens(got) == tokens(expected)
    assert got[0].outputs[0].logprobs == expected[0].outputs[0].logprobs
    both_ways(counts)
    draft_model = spec.engine.speculator.draft
    assert not draft_model._mirrors and draft_model.blocks.num_free_blocks == draft_model.blocks.num_blocks


def test_a_failing_draft_model_costs_only_its_proposals(
    llama: str, draft: str, base: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft model raising: the step runs without proposals, its reserved blocks and a seeded
    request's pre-drawn noise go back, and the outputs are those without speculation."""
    spec = LLM(
        llama,
        **OPTIONS,
        speculative_config={"model": draft, "num_speculative_tokens": 3, "draft_policy": "always"},
    )

    def broken(wanted: Any) -> Any:
        raise RuntimeError("the draft is down")

    monkeypatch.setattr(spec.engine.speculator.draft, "propose", broken)
    prompts = repetitive(3, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=13, max_tokens=20, ignore_eos=True)] * 2  # fmt: skip
    expected, _ = run(base, prompts, params[:3])
    got, counts = run(spec, prompts, params[:3])
    assert tokens(got) == tokens(expected) and counts["num_drafts"] == 0


def test_draft_adapters_propose_for_their_target_adapter(
    llama: str, base: LLM, adapters: dict[str, LoRARequest]
) -> None:
    """The target itself as the draft, with "all7"'s own adapter as its draft adapter: its requests'
    proposals are all accepted, sampled ones too (the draft samples with the target's draws), while
    "qv", which has no draft adapter, proposes with the base draft and gets some rejected."""
    config = {"model": llama, "num_speculative_tokens": 3, "draft_policy": "always",
              "draft_lora_modules": {"all7": adapters["all7"].lora_path}}  # fmt: skip
    spec = LLM(llama, **OPTIONS, speculative_config=config)
    prompts = repetitive(4, seed=8)
    loras = [adapters["all7"], adapters["qv"], adapters["all7"], adapters["qv"]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)] * 2  # fmt: skip
    expected, _ = run(base, prompts, params, loras)
    got, _ = run(spec, prompts, params, loras)
    assert tokens(got) == tokens(expected)
    by_adapter = spec.engine.stats()["spec_decode"]
    assert by_adapter["all7"]["num_draft_tokens"] == by_adapter["all7"]["num_accepted_tokens"] > 0
    assert 0 < by_adapter["qv"]["num_accepted_tokens"] < by_adapter["qv"]["num_draft_tokens"]


def test_a_draft_must_share_the_tokenizer(
    llama: str, draft: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from transformers import LlamaConfig

    other = str(tmp_path_factory.mktemp("other-vocab"))
    vocab = LlamaConfig.from_pretrained(llama).vocab_size
    save_random_model(other, LlamaConfig(vocab_size=vocab + 8, **TINY_SHAPE), seed=5)
    for name in os.listdir(draft):
        if not name.startswith(("config", "model", "generation")):
            shutil.copy(os.path.join(draft, name), other)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama, **OPTIONS, speculative_config={"model": other, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(llama, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20,
            speculative_config={"model": llama, "num_speculative_tokens": 2, "draft_lora_modules": {"a": llama}})  # fmt: skip


def _exact_distribution(
    hf: Any, prompt: list[int], allowed: list[int], temperature: float
) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3) of the target, sampling among `allowed` at `temperature`, from transformers."""

    def step(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1, allowed].float()
        return torch.softmax(logits / temperature, dim=-1)

    probs = {}
    for first in range(3):
        p1 = step(())[first]
        for second in range(3):
            p2 = step((allowed[first],))[second]
            p3 = step((allowed[first], allowed[second]))
            for third in range(3):
                probs[(allowed[first], allowed[second], allowed[third])] = float(p1 * p2 * p3[third])
    return probs


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_speculation_keeps_the_distribution(
    method: str, llama: str, draft: str, hf_model: Any
) -> None:
    """4000 unseeded samples of three tokens (engine seed fixed: a deterministic run) from a three-token
    vocabulary: their 27 joint frequencies pass a chi-square test against the target's probabilities,
    with proposals at token 2 accepted and rejected; for the ngram method the acceptance rate is the
    point-mass rule's, sum over t1 of p(t1) p(proposal(t1) | t1)."""
    g = torch.Generator().manual_seed(12)
    allowed = torch.randperm(500, generator=g)[:3].add(10).tolist()
    prompt = torch.randint(10, 500, (5,), generator=g).tolist() + allowed * 3
    config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 1, "draft_policy": "always"}  # fmt: skip
    if method == "draft_model":
        config = {"model": draft, "num_speculative_tokens": 2, "draft_policy": "always"}
    llm = LLM(llama, dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20, max_num_seqs=256,
              max_num_batched_tokens=4096, block_size=4, seed=2024, speculative_config=config)  # fmt: skip
    samples = 4000  # as 32 requests of n=125 (one request per sample spends its time in admission)
    params = SamplingParams(n=125, temperature=1.3, max_tokens=3, ignore_eos=True, allowed_token_ids=allowed)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 32, params, use_tqdm=False)
    observed: dict[tuple[int, ...], int] = {}
    for out in outs:
        for choice in out.outputs:
            key = tuple(choice.token_ids)
            observed[key] = observed.get(key, 0) + 1
    exact = _exact_distribution(hf_model(llama), prompt, allowed, 1.3)
    assert set(observed) <= set(exact)
    chi2 = sum((observed.get(key, 0) - samples * p) ** 2 / (samples * p) for key, p in exact.items())
    assert chi2 < CHI2_26_AT_1E3, (chi2, observed, exact)
    counts = counters(llm)
    assert counts["num_drafts"] == samples and 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
    if method == "ngram":  # one proposal per request, a function of t1
        proposal = {t: NgramIndex(1, 1).propose(prompt + [t], 1)[0] for t in allowed}
        rate = sum(p for (t1, t2, _), p in exact.items() if t2 == proposal[t1])  # P(t2 = proposal(t1))
        expected, sd = samples * rate, (samples * rate * (1 - rate)) ** 0.5
        assert abs(counts["num_accepted_tokens"] - expected) < 4 * sd
