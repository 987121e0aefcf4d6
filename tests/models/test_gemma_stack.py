"""The Gemma family's decoder stack as one C call (models/gemma_stack.py) against the Python loop of
gemma.py over the same kernels: bit-for-bit the same tokens and logprobs for Gemma, Gemma-2 (sandwich
norms, softcap, 1:1 sliding layers) and Gemma-3 (q/k norms, 5:1 sliding layers, two rope bases), in
float32 and bfloat16, base and mixed LoRA batches (more adapters than slots), prefill chunks beside
decodes; and the stack follows norm weights written in place."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.tiny_gemma import GEMMA_ARCHS, save_tiny_gemma
from transformers import AutoTokenizer

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.layers import fused_cpu, gemm_cpu, paged_attention_cpu
from loraserve.lora.request import LoRARequest
from loraserve.models.gemma_stack import GemmaDecoderStack

DTYPES = [torch.float32, torch.bfloat16]
TARGETS = [
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ["v_proj", "down_proj"],
    ["up_proj", "o_proj"],
]


def _serves(dtype: torch.dtype) -> bool:
    return (
        gemm_cpu.block_layout(dtype) != 0
        and fused_cpu.kernel_available()
        and paged_attention_cpu.kernel_available()
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, tuple[str, Any]]:
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    out = {}
    for arch in GEMMA_ARCHS:
        path = str(tmp_path_factory.mktemp(f"stack-{arch}"))
        out[arch] = (path, save_tiny_gemma(path, arch, tokenizer_dir, vocab_size, seed=11))
    return out


@pytest.fixture
def stack_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool | None]]:
    """One entry per step that asked the stack: True where it ran the step, False where it declined."""
    runs: list[bool | None] = []
    run = GemmaDecoderStack.run

    def counted(self: GemmaDecoderStack, *args: Any) -> Any:
        runs.append(None)
        out = run(self, *args)
        runs[-1] = out is not None
        return out

    monkeypatch.setattr(GemmaDecoderStack, "run", counted)
    yield runs


def _prompts(count: int, seed: int, max_len: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 400, (int(n),), generator=g).tolist()
        for n in torch.randint(2, max_len, (count,), generator=g)
    ]


def _outputs(
    llm: LLM,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    stack: bool,
    loras: list[LoRARequest | None] | None = None,
) -> list[Any]:
    monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", "1" if stack else "0")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
            [{t: lp.logprob for t, lp in step.items()} for step in o.prompt_logprobs[1:]],
        )
        for o in outs
    ]


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_equals_python_loop(
    models: dict[str, tuple[str, Any]],
    arch: str,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    stack_runs: list[bool | None],
) -> None:
    """Prefill chunks beside decodes (a small token budget splits the prompts), prompts past the
    6-token window: every step runs in the stack and equals the loop's bit for bit."""
    if not _serves(dtype):
        pytest.skip(f"the C linear kernel does not serve {dtype} on this CPU")
    llm = LLM(
        models[arch][0],
        dtype=str(dtype).removeprefix("torch."),
        max_num_batched_tokens=40,
        max_num_seqs=6,
        enable_prefix_caching=False,
    )
    prompts = _prompts(6, seed=len(arch))
    loop = _outputs(llm, prompts, monkeypatch, stack=False)
    assert stack_runs == []
    stacked = _outputs(llm, prompts, monkeypatch, stack=True)
    assert stack_runs and all(stack_runs)
    assert stacked == loop
    assert all(math.isfinite(lp) for _, steps, _ in stacked for step in steps for lp in step.values())


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_equals_python_loop_with_adapters(
    models: dict[str, tuple[str, Any]],
    arch: str,
    dtype: torch.dtype,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    stack_runs: list[bool | None],
) -> None:
    """Three adapters of ranks 4, 8, 12 (different targets) over two slots, beside the base model:
    every step runs in the stack (the LoRA kernel's terms bound per linear) and equals the loop's."""
    if not _serves(dtype):
        pytest.skip(f"the C linear kernel does not serve {dtype} on this CPU")
    path, hf = models[arch]
    requests = []
    for i, targets in enumerate(TARGETS):
        folder = str(tmp_path / f"a{i}")
        save_peft_adapter(
            hf, folder, seed=40 + i, base_name=path, r=4 + 4 * i, lora_alpha=16, target_modules=targets
        )
        requests.append(LoRARequest(f"a{i}", i + 1, folder))
    llm = LLM(
        path,
        dtype=str(dtype).removeprefix("torch."),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_seqs=6,
        enable_prefix_caching=False,
    )
    prompts = _prompts(6, seed=7)
    loras = [requests[i % 3] if i % 4 else None for i in range(6)]
    loop = _outputs(llm, prompts, monkeypatch, stack=False, loras=loras)
    stacked = _outputs(llm, prompts, monkeypatch, stack=True, loras=loras)
    assert stacked == loop
    assert stack_runs and all(stack_runs)


def test_stack_follows_norm_weights_written_in_place(
    models: dict[str, tuple[str, Any]], monkeypatch: pytest.MonkeyPatch, stack_runs: list[bool | None]
) -> None:
    """The stack binds each norm's float32 (1 + w): a weight written in place (as loading does) gives a
    new scale, and the stack's outputs stay the loop's after the write."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    llm = LLM(models["gemma3"][0], dtype="float32", max_num_seqs=2, enable_prefix_caching=False)
    prompts = _prompts(2, seed=1)
    before = _outputs(llm, prompts, monkeypatch, stack=True)
    layers = llm.engine.model.model.layers
    with torch.no_grad():
        layers[1].pre_feedforward_layernorm.weight.mul_(3.0)
        layers[2].self_attn.q_norm.weight.add_(0.5)
    stacked = _outputs(llm, prompts, monkeypatch, stack=True)
    loop = _outputs(llm, prompts, monkeypatch, stack=False)
    assert stacked == loop
    assert stacked != before
    assert all(stack_runs)
