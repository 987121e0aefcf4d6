"""Native Gemma, Gemma-2 and Gemma-3 (text) against transformers and PEFT.

Tiny random models shaped like the real configs (tests/support/tiny_gemma.py): greedy tokens equal
transformers' `generate` and prompt logprobs match in float32; in bfloat16 every logprob stays within
bf16 noise of float32 transformers; PEFT adapters of different ranks in one mixed batch with fewer
slots than adapters, through the C LoRA kernel and the torch ops, in both dtypes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support.parity import (
    bf16_twin,
    greedy_params,
    memoized,
    peft_logprobs,
    peft_model,
    random_prompts,
    with_adapter,
)
from support.parity import check_bf16 as _check_bf16
from support.parity import check_exact as _check_exact
from support.parity import hf_logprobs as _logprobs
from support.stack_calls import count_lora_kernel_steps
from support.tiny_gemma import GEMMA_ARCHS, gemma_config, save_tiny_gemma
from support.triton_lora import check_mixed_batch_through_triton, needs_triton
from transformers import AutoTokenizer

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.layers import paged_attention_cpu
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest
from loraserve.models.gemma import FULL, SLIDING
from loraserve.models.gemma_stack import GemmaDecoderStack

NUM_NEW = 8
PROMPT_LENGTHS = (3, 17, 30)  # the longer prompts reach past the 6-token window
ADAPTERS: dict[str, dict[str, Any]] = {
    "all7_r8": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv_rslora_r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp_r16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, tuple[str, Any]]:
    """arch -> (folder, the float32 HF model) for every Gemma generation."""
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    models = {}
    for arch in GEMMA_ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        models[arch] = (path, save_tiny_gemma(path, arch, tokenizer_dir, vocab_size))
    return models


@pytest.fixture(scope="module")
def gemma_adapters(
    gemma_models: dict[str, tuple[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, str]]:
    """arch -> {adapter name: folder}."""
    out: dict[str, dict[str, str]] = {}
    for arch, (path, hf) in gemma_models.items():
        root = tmp_path_factory.mktemp(f"{arch}-adapters")
        out[arch] = {}
        for i, (name, kwargs) in enumerate(ADAPTERS.items()):
            out[arch][name] = str(root / name)
            save_peft_adapter(hf, out[arch][name], seed=70 + i, base_name=path, **kwargs)
    return out


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, vocab_size, seed)


def _greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _params() -> SamplingParams:
    return greedy_params(NUM_NEW)


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_float32_matches_transformers(
    arch: str, gemma_models: dict[str, tuple[str, Any]], linear_backend: str
) -> None:
    path, hf = gemma_models[arch]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    assert type(llm.engine.model).__module__.startswith("loraserve.models.gemma")
    prompts = _prompts(hf.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        _check_exact(out, prompt, _greedy(hf, prompt), _logprobs(hf, prompt))


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path: Any, tokenizer_dir: str) -> None:
    """Gemma3ForConditionalGeneration: the language model's tensors under their multimodal names, the
    vision tower skipped; text prompts answered as transformers answers them, and a PEFT adapter
    trained on the multimodal model (its language model's modules) served as PEFT serves it."""
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    path, adapter = str(tmp_path / "model"), str(tmp_path / "adapter")
    hf = save_tiny_gemma(path, "gemma3_multimodal", tokenizer_dir, vocab_size)
    targets = r".*language_model.*\.(q_proj|v_proj|down_proj)"
    save_peft_adapter(hf, adapter, seed=3, base_name=path, r=8, lora_alpha=16, target_modules=targets)
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8)
    assert type(llm.engine.model).__name__ == "Gemma3ForConditionalGeneration"
    prompts = _prompts(vocab_size)
    peft = peft_model(path, {"mm": adapter})
    for name in (None, "mm"):
        request = LoRARequest("mm", 1, adapter) if name else None
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], _params(), lora_request=request, use_tqdm=False
        )
        for prompt, out in zip(prompts, outputs):
            _check_exact(out, prompt, _peft_greedy(peft, name, prompt), peft_logprobs(peft, name, prompt))
    moved = (peft_logprobs(peft, "mm", prompts[-1]) - peft_logprobs(peft, None, prompts[-1])).abs().max()
    assert moved > 1.0
    # Without an image processor in its folder the checkpoint takes no images: they are refused by name.
    from PIL import Image

    assert llm.engine.mm_processor is None
    with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration\) takes text only"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, use_tqdm=False)


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_bfloat16_within_bf16_noise_of_transformers(
    arch: str, gemma_models: dict[str, tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 serving through the C kernels (the paged attention kernel counted, called from Python or
    inside the C decoder stack) against float32 transformers scoring the same tokens."""
    path, hf = gemma_models[arch]
    calls = []
    kernel, stack_run = paged_attention_cpu.write_and_attend, GemmaDecoderStack.run
    monkeypatch.setattr(
        paged_attention_cpu, "write_and_attend", lambda q, *args: calls.append(q.dtype) or kernel(q, *args)
    )

    def counted_run(self: GemmaDecoderStack, residual: torch.Tensor, *args: Any) -> Any:
        result = stack_run(self, residual, *args)
        if result is not None:
            calls.append(residual.dtype)
        return result

    monkeypatch.setattr(GemmaDecoderStack, "run", counted_run)
    llm = LLM(path, dtype="bfloat16", max_num_batched_tokens=64)
    prompts = _prompts(hf.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    assert set(calls) == {torch.bfloat16}
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        _check_bf16(
            out, prompt, lambda ids: _logprobs(hf, ids), lambda ids: _logprobs(hf_bf16, ids), f"prompt {i}"
        )


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_tiny_models_exercise_every_gemma_feature(
    arch: str, gemma_models: dict[str, tuple[str, Any]]
) -> None:
    """The parity above means something only if the window, the softcaps and (Gemma-3) the local rope
    base change transformers' outputs on these prompts, and our layers mix both kinds."""
    import transformers

    path, hf = gemma_models[arch]
    prompt = _prompts(hf.config.vocab_size)[-1]
    reference = _logprobs(hf, prompt)
    changes: dict[str, Any] = {"sliding_window": 64}
    if arch == "gemma2":
        changes |= {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    else:
        changes |= {
            "rope_parameters": {kind: {"rope_type": "default", "rope_theta": 1e6} for kind in (SLIDING, FULL)}
        }
    for key, value in changes.items():
        config = gemma_config(arch, hf.config.vocab_size)
        setattr(config, key, value)
        other = transformers.AutoModelForCausalLM.from_config(config).eval()
        other.load_state_dict(hf.state_dict())
        assert (_logprobs(other, prompt) - reference).abs().max() > 0.05, key
    llm = LLM(path, dtype="float32")
    kinds = [layer.self_attn.attn.use_sliding_window for layer in llm.engine.model.model.layers]
    assert kinds == [kind == SLIDING for kind in hf.config.layer_types] and len(set(kinds)) == 2


def _peft_greedy(model: Any, name: str | None, prompt: list[int]) -> list[int]:
    compute = lambda: with_adapter(model, name, lambda: _greedy(model, prompt))  # noqa: E731
    return memoized(model, ("generate", name, tuple(prompt)), compute)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_mixed_batch_matches_peft(
    arch: str,
    cpu_kernel: str,
    dtype: str,
    gemma_models: dict[str, tuple[str, Any]],
    gemma_adapters: dict[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Base requests and three adapters of ranks 4, 8 and 16 interleaved in one batch over two slots,
    through the C LoRA kernel (its calls counted, from Python or inside the C decoder stack) or the
    torch ops, against PEFT in float32."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    kernel_dtypes = count_lora_kernel_steps(monkeypatch)  # from Python or inside the C decoder stack
    path, hf = gemma_models[arch]
    adapters = gemma_adapters[arch]
    prompts = _prompts(hf.config.vocab_size, seed=1)
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_batched_tokens=32)
    requests = {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(adapters.items())}
    cases = [(name, i) for name in [None, *adapters] for i in range(len(prompts))]
    cases = cases[::2] + cases[1::2]  # interleave adapters and base requests in one batch
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in cases],
        _params(),
        lora_request=[requests[n] if n else None for n, _ in cases],
        use_tqdm=False,
    )
    served = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    expected = {dtype} if cpu_kernel == "1" and lora_cpu.kernel_available() else set()
    assert {served[d] for d in kernel_dtypes} == expected
    peft = peft_model(path, adapters)
    peft_bf16 = bf16_twin(peft) if dtype == "bfloat16" else None
    for out, (name, i) in zip(outputs, cases):
        reference_of = lambda ids, name=name: peft_logprobs(peft, name, ids)  # noqa: E731
        if peft_bf16 is None:
            _check_exact(out, prompts[i], _peft_greedy(peft, name, prompts[i]), reference_of(prompts[i]))
        else:
            _check_bf16(
                out,
                prompts[i],
                reference_of,
                lambda ids, name=name: peft_logprobs(peft_bf16, name, ids),
                f"adapter {name}, prompt {i}",
            )
        if name is not None:  # each adapter moves its logprobs far beyond any bound above
            moved = (reference_of(prompts[i]) - peft_logprobs(peft, None, prompts[i])).abs().max().item()
            assert moved > 1.0, f"adapter {name} hardly changes the model: {moved:.3f}"


@needs_triton
@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_mixed_batch_matches_peft_through_triton(
    arch: str,
    gemma_models: dict[str, tuple[str, Any]],
    gemma_adapters: dict[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mixed batch through the Triton kernels under the interpreter (float32; a prompt past the
    sliding window), against PEFT."""
    path, hf = gemma_models[arch]
    prompt = _prompts(hf.config.vocab_size, seed=1)[-1][:9]
    check_mixed_batch_through_triton(monkeypatch, path, gemma_adapters[arch], prompt)
