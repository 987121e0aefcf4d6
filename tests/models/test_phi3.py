"""Native Phi-3 / Phi-3.5 / Phi-4-mini against transformers and PEFT.

Tiny random models shaped like Phi-3.5-mini and Phi-4-mini (tests/support/tiny_phi3.py), with LongRoPE
over an original length of 24: the 30-token prompt runs on the long factors, the others stay on the
short ones (their prompt plus the generated tokens stay within 24; a sequence crossing the length
mid-decode is covered separately below). Greedy tokens equal transformers' `generate` and prompt
logprobs match in float32; bf16 stays within bf16 noise of float32 transformers; PEFT adapters of
different ranks in one mixed batch with fewer slots than adapters, on the fused qkv_proj/gate_up_proj
and on separate q/k/v and gate/up modules, through the C LoRA kernel and the torch ops.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from support.fused_adapters import PHI3_PARTS, fused_sizes, save_split_adapter, split_to_fused
from support.parity import (
    bf16_twin,
    check_bf16,
    check_exact,
    greedy_params,
    hf_greedy,
    hf_logprobs,
    peft_greedy,
    peft_logprobs,
    peft_model,
    random_prompts,
)
from support.tiny_phi3 import ORIGINAL, PHI3_ARCHS, phi3_config, respell_as_su, save_tiny_phi3
from support.triton_lora import check_mixed_batch_through_triton, needs_triton
from transformers import AutoTokenizer

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.layers import paged_attention_cpu
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest
from loraserve.models.llama_stack import DecoderStack

NUM_NEW = 8
PROMPT_LENGTHS = (3, 14, 30)  # 14 + 8 stays within ORIGINAL; 30 is past it (and past the window)
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# Adapters on the checkpoint's fused modules (PEFT scores them as they are) and on the parts (PEFT
# scores their fused equivalent, `split_to_fused`).
FUSED_ADAPTERS: dict[str, dict[str, Any]] = {
    "fused_r8": dict(r=8, lora_alpha=16, target_modules=FUSED),
    "qkv_rslora_r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["qkv_proj", "down_proj"]),
}
SPLIT_ADAPTERS: dict[str, dict[str, Any]] = {
    "split_r4": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    ),
    "split_k_up_r2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def phi3_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, tuple[str, Any]]:
    """arch -> (folder, the float32 HF model)."""
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    models = {}
    for arch in PHI3_ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        models[arch] = (path, save_tiny_phi3(path, arch, tokenizer_dir, vocab_size))
    return models


@pytest.fixture(scope="module")
def phi3_adapters(
    phi3_models: dict[str, tuple[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """arch -> ({name: adapter served}, {name: adapter PEFT scores}): fused ones are both, split ones
    are served as trained and scored through their fused equivalent."""
    out = {}
    for arch, (path, hf) in phi3_models.items():
        root = tmp_path_factory.mktemp(f"{arch}-adapters")
        served, scored = {}, {}
        for i, (name, kwargs) in enumerate(FUSED_ADAPTERS.items()):
            served[name] = scored[name] = str(root / name)
            save_peft_adapter(hf, served[name], seed=70 + i, base_name=path, **kwargs)
        for i, (name, kwargs) in enumerate(SPLIT_ADAPTERS.items()):
            served[name], scored[name] = str(root / name), str(root / f"{name}-fused")
            save_split_adapter(hf.config, served[name], seed=80 + i, base_name=path, **kwargs)
            split_to_fused(served[name], scored[name], PHI3_PARTS, fused_sizes(hf.config))
        out[arch] = (served, scored)
    return out


def _generate(llm: LLM, prompts: list[list[int]], **kwargs: Any) -> list[Any]:
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy_params(NUM_NEW), use_tqdm=False, **kwargs
    )


@pytest.mark.parametrize("arch", PHI3_ARCHS)
def test_float32_matches_transformers(
    arch: str, phi3_models: dict[str, tuple[str, Any]], linear_backend: str
) -> None:
    path, hf = phi3_models[arch]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    assert type(llm.engine.model).__name__ == "Phi3ForCausalLM"
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size)
    for prompt, out in zip(prompts, _generate(llm, prompts)):
        check_exact(out, prompt, hf_greedy(hf, prompt, NUM_NEW), hf_logprobs(hf, prompt))


@pytest.mark.parametrize("arch", PHI3_ARCHS)
def test_bfloat16_within_bf16_noise_of_transformers(
    arch: str, phi3_models: dict[str, tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 serving through the C kernels against float32 transformers scoring the same tokens: the
    paged attention kernel counted, called from Python (the layer loop) or inside the C decoder stack
    (Phi-3.5's full rotary, where the C linear kernel serves bf16)."""
    path, hf = phi3_models[arch]
    calls = []
    kernel, stack_run = paged_attention_cpu.write_and_attend, DecoderStack.run
    monkeypatch.setattr(
        paged_attention_cpu, "write_and_attend", lambda q, *args: calls.append(q.dtype) or kernel(q, *args)
    )

    def counted_run(self: DecoderStack, residual: torch.Tensor, *args: Any) -> Any:
        result = stack_run(self, residual, *args)
        if result is not None:
            calls.append(residual.dtype)
        return result

    monkeypatch.setattr(DecoderStack, "run", counted_run)
    llm = LLM(path, dtype="bfloat16", max_num_batched_tokens=64)
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size)
    outputs = _generate(llm, prompts)
    assert set(calls) == {torch.bfloat16}
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        check_bf16(
            out, prompt, lambda ids: hf_logprobs(hf, ids), lambda ids: hf_logprobs(hf_bf16, ids), f"{i}"
        )


@pytest.mark.parametrize("arch", PHI3_ARCHS)
def test_the_tiny_models_exercise_every_phi3_feature(
    arch: str, phi3_models: dict[str, tuple[str, Any]]
) -> None:
    """The parity above means something only if each feature changes transformers' outputs on these
    prompts: the long factors on the long prompt, the short factors on the short one, the sliding
    window (Phi-3.5 shape), the partial rotary (Phi-4-mini shape)."""
    path, hf = phi3_models[arch]
    _, short, long = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size)
    assert len(short) + NUM_NEW <= ORIGINAL < len(long)
    rope = hf.config.rope_parameters
    ones = [1.0] * len(rope["short_factor"])
    changes: list[tuple[str, dict[str, Any], list[int]]] = [
        ("long_factor", {"rope_parameters": {**rope, "long_factor": ones}}, long),
        ("short_factor", {"rope_parameters": {**rope, "short_factor": ones}}, short),
    ]
    if arch == "phi3.5":
        changes.append(("sliding_window", {"sliding_window": None}, long))
    else:
        full = {**rope, "partial_rotary_factor": 1.0, "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}
        changes.append(("partial_rotary_factor", {"rope_parameters": full}, short))
    for what, change, prompt in changes:
        config = phi3_config(arch, hf.config.vocab_size)
        for key, value in change.items():
            setattr(config, key, value)
        other = transformers.AutoModelForCausalLM.from_config(config).eval()
        other.load_state_dict(hf.state_dict())
        assert (hf_logprobs(other, prompt) - hf_logprobs(hf, prompt)).abs().max() > 0.05, what
    llm = LLM(path, dtype="float32")
    rotary = llm.engine.model.model.rotary
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    assert rotary.long and rotary.head_dim == int(head_dim * rope["partial_rotary_factor"])
    assert (rotary.head_dim < head_dim) == (arch == "phi4")


def test_su_spelled_config_serves_longrope(tmp_path: Any, tokenizer_dir: str) -> None:
    """Early Phi-3 configs spell LongRoPE `rope_scaling: {"type": "su"}` with the original length at
    the top level (transformers cannot parse them); served as the same model with "longrope"."""
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    path = str(tmp_path / "su")
    hf = save_tiny_phi3(path, "phi3.5", tokenizer_dir, vocab_size)
    respell_as_su(path)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size)
    for prompt, out in zip(prompts, _generate(llm, prompts)):
        check_exact(out, prompt, hf_greedy(hf, prompt, NUM_NEW), hf_logprobs(hf, prompt))


def test_crossing_the_original_length_mid_decode_keeps_the_cached_short_prefix(
    phi3_models: dict[str, tuple[str, Any]],
) -> None:
    """A sequence that passes the original length while decoding rotates its new tokens with the long
    factors and keeps its cached prefix as computed (short factors): exactly transformers' model fed
    one token at a time with a cache. (transformers' `generate` instead recomputes the whole sequence
    once, at the crossing; see DESIGN.md.)"""
    path, hf = phi3_models["phi3.5"]
    prompt = random_prompts((ORIGINAL - 3,), hf.config.vocab_size, seed=5)[0]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    ours = _generate(llm, [prompt])[0].outputs[0]
    cache, ids, tokens, logprobs = None, torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(NUM_NEW):
            result = hf(ids, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            step = torch.log_softmax(result.logits[0, -1].float(), -1)
            tokens.append(int(step.argmax()))
            logprobs.append(step.max().item())
            ids = torch.tensor([[tokens[-1]]])
    assert ours.token_ids == tokens
    served = [step[t].logprob for step, t in zip(ours.logprobs, ours.token_ids)]
    assert max(abs(a - b) for a, b in zip(served, logprobs)) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
@pytest.mark.parametrize("arch", PHI3_ARCHS)
def test_mixed_batch_matches_peft(
    arch: str,
    cpu_kernel: str,
    dtype: str,
    phi3_models: dict[str, tuple[str, Any]],
    phi3_adapters: dict[str, tuple[dict[str, str], dict[str, str]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Base requests and four adapters of ranks 2 to 8 (fused and split modules) interleaved in one
    batch over two slots, through the C LoRA kernel (its calls counted, from Python or inside the C
    decoder stack) or the torch ops, against PEFT in float32."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    kernel_dtypes = []
    run, stack_run = lora_cpu.run, DecoderStack.run
    monkeypatch.setattr(lora_cpu, "run", lambda *args: kernel_dtypes.append(args[0].dtype) or run(*args))

    def counted_run(self: DecoderStack, residual: torch.Tensor, *args: Any) -> Any:
        result = stack_run(self, residual, *args)  # the stack calls the LoRA kernel from C
        if result is not None and args[-1].lora is not None:
            kernel_dtypes.append(residual.dtype)
        return result

    monkeypatch.setattr(DecoderStack, "run", counted_run)
    path, hf = phi3_models[arch]
    served, scored = phi3_adapters[arch]
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size, seed=1)
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_batched_tokens=64)
    requests = {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(served.items())}
    cases = [(name, i) for name in [None, *served] for i in range(len(prompts))]
    cases = cases[::2] + cases[1::2]  # interleave adapters and base requests in one batch
    outputs = _generate(
        llm, [prompts[i] for _, i in cases], lora_request=[requests[n] if n else None for n, _ in cases]
    )
    expected = {getattr(torch, dtype)} if cpu_kernel == "1" and lora_cpu.kernel_available() else set()
    assert set(kernel_dtypes) == expected
    peft = peft_model(path, scored)
    peft_bf16 = bf16_twin(peft) if dtype == "bfloat16" else None
    for out, (name, i) in zip(outputs, cases):
        reference_of = lambda ids, name=name: peft_logprobs(peft, name, ids)  # noqa: E731
        if peft_bf16 is None:
            check_exact(
                out, prompts[i], peft_greedy(peft, name, prompts[i], NUM_NEW), reference_of(prompts[i])
            )
        else:
            check_bf16(
                out,
                prompts[i],
                reference_of,
                lambda ids, name=name: peft_logprobs(peft_bf16, name, ids),
                f"adapter {name}, prompt {i}",
            )
        if name is not None:  # each adapter moves its logprobs far beyond any bound above
            moved = (reference_of(prompts[i]) - peft_logprobs(peft, None, prompts[i])).abs().max().item()
            assert moved > 1.0, f"adapter {name} hardly changes the model: {moved:.3f}"


@pytest.mark.parametrize("split", [True, False])
def test_prefix_cache_keeps_long_sequences_apart_from_short_ones(
    split: bool, phi3_models: dict[str, tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt sharing its first blocks with an earlier short one must not reuse the short one's
    cached blocks (computed on the short factors); long prompts still share theirs. With the split
    switched off (split=False) the reuse happens and the outputs leave transformers': what the test
    guards against."""
    from loraserve.engine import block_manager

    path, hf = phi3_models["phi3.5"]
    if not split:
        init = block_manager.BlockManager.__init__
        monkeypatch.setattr(
            block_manager.BlockManager,
            "__init__",
            lambda self, *args: init(self, *args[:3], None),
        )
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64, block_size=16)
    blocks = llm.engine.block_manager
    assert (blocks.rope_switch_length == ORIGINAL) == split
    short, tail = random_prompts((20, 12), hf.config.vocab_size, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    llm.generate([{"prompt_token_ids": short}], params, use_tqdm=False)
    hits = blocks.num_prefix_hit_tokens
    long = short + tail  # 32 tokens: past ORIGINAL, its first block is the short prompt's
    out = llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)[0].outputs[0]
    assert (blocks.num_prefix_hit_tokens == hits) == split
    ids = long + list(out.token_ids)
    reference = hf_logprobs(hf, ids)[len(long) - 1 : -1]
    errors = [
        abs(step[t].logprob - reference[i, t].item())
        for i, (step, t) in enumerate(zip(out.logprobs, out.token_ids))
    ]
    assert (max(errors) < 1e-4) == split, max(errors)
    if split:  # a second long prompt with the same prefix reuses the first one's long blocks
        hits = blocks.num_prefix_hit_tokens
        llm.generate([{"prompt_token_ids": long + [5]}], params, use_tqdm=False)
        assert blocks.num_prefix_hit_tokens > hits


def test_a_long_prompt_prefilled_in_chunks_stays_on_the_long_factors(
    phi3_models: dict[str, tuple[str, Any]],
) -> None:
    """A 30-token prompt under a 16-token budget: its first chunk ends within the original length, yet
    the whole prompt is longer, so every chunk reads the long factors, as transformers' one forward."""
    path, hf = phi3_models["phi3.5"]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=1)
    prompt = random_prompts((30,), hf.config.vocab_size, seed=2)[0]
    out = _generate(llm, [prompt])[0]
    check_exact(out, prompt, hf_greedy(hf, prompt, NUM_NEW), hf_logprobs(hf, prompt))


@needs_triton
def test_mixed_batch_matches_peft_through_triton(
    phi3_models: dict[str, tuple[str, Any]],
    phi3_adapters: dict[str, tuple[dict[str, str], dict[str, str]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fused and split adapters in one batch through the Triton kernels under the interpreter (float32,
    Phi-3.5's LongRoPE, the prompt past the window), against PEFT on the fused equivalents."""
    path, hf = phi3_models["phi3.5"]
    served, scored = phi3_adapters["phi3.5"]
    prompt = random_prompts((12,), hf.config.vocab_size, seed=3)[0]
    check_mixed_batch_through_triton(monkeypatch, path, served, prompt, scored=scored)
