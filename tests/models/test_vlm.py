"""Vision-language models against transformers and PEFT, per architecture (tiny random models shaped
like the real configs: tests/support/tiny_vlm.py): one mixed batch of image and text-only requests,
the base model and two adapters (one on the language model, one with tower and connector modules too,
served with --enable-tower-connector-lora), greedy tokens and logprobs equal to transformers'
`generate` in float32 and within bf16 noise of the float32 oracle in bfloat16. Then what the flag
changes (without it an adapter's tower modules are skipped, as vLLM does), and Gemma-3's image tokens
attending to each other both ways."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.parity import BF16_FACTOR, BF16_FLOOR
from support.tiny_vlm import PLACEHOLDER, VLM_ARCHS, random_image, save_tiny_vlm
from support.vlm_oracle import (
    generate,
    hf_inputs,
    lora_requests,
    peft_vlm,
    processor_of,
    save_vlm_adapters,
    scored_logprobs,
)

from loraserve import LLM, SamplingParams

NUM_NEW = 6
Request = tuple[str, list[Any] | None, str | None]  # (prompt text, images, adapter)


@dataclass
class Case:
    arch: str
    path: str
    adapters: dict[str, str]
    peft: Any  # float32, both adapters loaded
    processor: Any


@pytest.fixture(scope="module")
def vlms(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, Case]:
    cases = {}
    for seed, arch in enumerate(VLM_ARCHS):
        path = str(tmp_path_factory.mktemp(f"vlm-{arch}"))
        hf = save_tiny_vlm(path, arch, tokenizer_dir, seed=seed)
        adapters = save_vlm_adapters(hf, arch, str(tmp_path_factory.mktemp(f"vlm-{arch}-adapters")), path)
        cases[arch] = Case(arch, path, adapters, peft_vlm(arch, path, adapters), processor_of(path))
    return cases


def _requests(arch: str) -> list[Request]:
    image = PLACEHOLDER[arch]
    wide, tall = random_image(64, 40, 1), random_image(30, 50, 2)
    return [
        (f"<s>describe {image} now", [wide], None),
        (f"<s>describe {image} now", [tall], None),
        (f"<s>compare {image} with {image} please", [wide, tall], "lm"),
        (f"<s>describe {image} now", [tall], "tower"),
        ("<s>text only, please", None, "lm"),
        ("<s>text only, please", None, None),
    ]


def _serve(llm: LLM, case: Case, requests: list[Request], params: SamplingParams | None = None) -> list[Any]:
    loras = lora_requests(case.adapters)
    prompts = [
        {"prompt": t, "multi_modal_data": {"image": i}} if i else {"prompt": t} for t, i, _ in requests
    ]
    params = params or SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    return llm.generate(
        prompts, params, lora_request=[loras[a] if a else None for *_, a in requests], use_tqdm=False
    )


def _engine(case: Case, dtype: str, tower_lora: bool = True) -> LLM:
    return LLM(
        case.path,
        dtype=dtype,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        enable_tower_connector_lora=tower_lora,
        kv_cache_memory_bytes=16 << 20,
    )


def _ours(out: Any) -> tuple[list[int], list[float]]:
    tokens = list(out.outputs[0].token_ids)
    return tokens, [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_float32_equals_transformers_and_peft_in_one_mixed_batch(arch: str, vlms: dict[str, Case]) -> None:
    case = vlms[arch]
    requests = _requests(arch)
    outputs = _serve(_engine(case, "float32"), case, requests)
    served = [_ours(out) for out in outputs]
    for (text, images, adapter), (tokens, logprobs) in zip(requests, served, strict=True):
        ref_tokens, ref_logprobs = generate(
            case.peft, adapter, hf_inputs(case.processor, arch, text, images), NUM_NEW
        )
        assert tokens == ref_tokens, (arch, adapter, text)
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4, (arch, adapter, text)
    # The images reach the model: the same text with another image is answered otherwise.
    assert max(abs(a - b) for a, b in zip(served[0][1], served[1][1])) > 0.05 or served[0][0] != served[1][0]


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_bfloat16_within_bf16_noise_of_the_float32_oracle(arch: str, vlms: dict[str, Case]) -> None:
    """Our bf16 logprobs (the prompt's, images included, and our own generated tokens') against float32
    PEFT scoring the same tokens, within BF16_FACTOR times what PEFT's own bf16 twin errs by on the
    prompt (at least BF16_FLOOR), and each generated token that close to PEFT's float32 choice
    (parity.check_bf16's rule: near-ties may break either way in bf16)."""
    case = vlms[arch]
    twin = copy.deepcopy(case.peft).to(torch.bfloat16)
    requests = [
        _requests(arch)[i] for i in (2, 3)
    ]  # two images under the LM adapter, one under the tower one
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    outputs = _serve(_engine(case, "bfloat16"), case, requests, params)
    for (text, images, adapter), out in zip(requests, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        ids = list(out.prompt_token_ids) + tokens
        ours = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(out.prompt_token_ids))]
        ours += _ours(out)[1]
        inputs = hf_inputs(case.processor, arch, text, images)
        assert inputs["input_ids"][0].tolist() == list(out.prompt_token_ids)
        rows, targets = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
        reference = scored_logprobs(case.peft, adapter, inputs, tokens)
        twin_inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
        theirs = reference[rows, targets]
        # transformers' own bf16 error, over the prompt's positions (images included): one forward
        prompt = len(out.prompt_token_ids) - 1
        hf_rows = scored_logprobs(twin, adapter, twin_inputs, [])[rows[:prompt], targets[:prompt]]
        hf_error = (hf_rows - theirs[:prompt]).abs().max()
        tolerance = max(BF16_FLOOR, BF16_FACTOR * hf_error.item())
        start = len(out.prompt_token_ids) - 1
        gap = (reference[start:].max(-1).values - theirs[start:]).max().item()
        error = (torch.tensor(ours) - theirs).abs().max().item()
        assert error <= tolerance and gap <= tolerance, (arch, adapter, text, error, gap, tolerance)


def test_without_the_flag_an_adapters_tower_modules_are_skipped(
    vlms: dict[str, Case], tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's rule: without --enable-tower-connector-lora only the language model's modules of an
    adapter apply (a warning names the skipped ones); served as PEFT serves the adapter less them."""
    case = vlms["llava"]
    tower = case.adapters["tower"]
    stripped = str(tmp_path / "lm-part")
    os.makedirs(stripped)
    tensors = load_file(os.path.join(tower, "adapter_model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if ".language_model." in k},
        os.path.join(stripped, "adapter_model.safetensors"),
    )
    with open(os.path.join(tower, "adapter_config.json"), encoding="utf-8") as f:
        config = f.read()
    with open(os.path.join(stripped, "adapter_config.json"), "w", encoding="utf-8") as f:
        f.write(config)
    requests: list[Request] = [("<s>describe <image> now", [random_image(30, 50, 2)], "tower")]
    with caplog.at_level(logging.WARNING, logger="loraserve.lora.lora_model"):
        tokens, logprobs = _ours(_serve(_engine(case, "float32", tower_lora=False), case, requests)[0])
    assert (
        "vision tower / connector modules" in caplog.text and "--enable-tower-connector-lora" in caplog.text
    )
    oracle = peft_vlm("llava", case.path, {"lm_part": stripped})
    inputs = hf_inputs(case.processor, "llava", *requests[0][:2])
    ref_tokens, ref_logprobs = generate(oracle, "lm_part", inputs, NUM_NEW)
    assert tokens == ref_tokens and max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
    with_tower = generate(case.peft, "tower", inputs, NUM_NEW)  # what the flag serves: another answer
    assert max(abs(a - b) for a, b in zip(with_tower[1], ref_logprobs)) > 0.05 or with_tower[0] != tokens


def test_gemma3_image_tokens_attend_both_ways(vlms: dict[str, Case]) -> None:
    """The prompt's logprobs after the image are transformers' with its bidirectional image mask, and
    measurably not those of a causal mask (so the parity above exercises it)."""
    case = vlms["gemma3"]
    text, images = f"<s>look {PLACEHOLDER['gemma3']} at this", [random_image(64, 40, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = LLM(case.path, dtype="float32", kv_cache_memory_bytes=16 << 20).generate(
        [{"prompt": text, "multi_modal_data": {"image": images}}], params, use_tqdm=False
    )[0]
    ids = list(out.prompt_token_ids)
    ours = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
    inputs = hf_inputs(case.processor, "gemma3", text, images)
    assert inputs["input_ids"][0].tolist() == ids
    with torch.no_grad(), case.peft.disable_adapter():
        both_ways = torch.log_softmax(case.peft(**inputs).logits[0].float(), -1)
        causal = torch.log_softmax(
            case.peft(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0].float(), -1
        )
    rows, targets = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    assert (ours - both_ways[rows, targets]).abs().max() < 1e-4
    assert (ours - causal[rows, targets]).abs().max() > 1e-2
