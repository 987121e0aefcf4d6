"""PEFT adapters on the native MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against PEFT.

Adapters of different ranks on attention, on the experts' stacked tensors (PEFT's target_parameters)
and on Qwen2-MoE's shared expert, in one mixed batch with fewer slots than adapters, through the C LoRA
kernel, the torch ops and the Triton kernels, in both dtypes; an adapter on one expert reaches only the
tokens routed to it; per-expert module adapters of older PEFT; scales and mixes on the expert terms;
expert tensors refused on a dense model. The models are conftest.py's `moe_models`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from support.moe_adapters import as_target_parameters, save_per_expert_adapter
from support.parity import bf16_twin, check_bf16_routed, hf_greedy_full, memoized
from support.tiny_moe import MOE_ARCHS
from support.triton_lora import check_mixed_batch_through_triton, needs_triton
from test_gemma import _check_exact, _logprobs, _params, _prompts
from transformers import AutoModelForCausalLM

from loraserve import LLM
from loraserve.demo.random_model import save_peft_adapter
from loraserve.errors import LoRAAdapterError
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# Ranks 8, 4 and 16: attention and both expert tensors; q/v only (rsLoRA); o_proj, the down experts and
# gate/up/down by module name: plain Linears in Qwen2-MoE's shared expert and dense layer, and on the
# experts of the Qwen-MoE and OLMoE models PEFT moves them onto the fused tensors (gate_up at rank 32).
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn_experts_r8": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS
    ),
    "qv_rslora_r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "down_experts_r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["experts.down_proj"],
    ),
}


@pytest.fixture(scope="module")
def moe_adapters(
    moe_models: dict[str, tuple[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, str]]:
    """arch -> {adapter name: folder}, written by PEFT on the float32 HF model."""
    out: dict[str, dict[str, str]] = {}
    for arch, (path, hf) in moe_models.items():
        root = tmp_path_factory.mktemp(f"{arch}-adapters")
        out[arch] = {}
        for i, (name, kwargs) in enumerate(ADAPTERS.items()):
            out[arch][name] = str(root / name)
            save_peft_adapter(hf, out[arch][name], seed=70 + i, base_name=path, **kwargs)
    return out


def _ref_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """A one-adapter reference's logprobs, once per (model, ids)."""
    return memoized(model, ("logprobs", tuple(ids)), lambda: _logprobs(model, ids))


def _ref_greedy(model: Any, prompt: list[int]) -> list[int]:
    return memoized(model, ("greedy", tuple(prompt)), lambda: hf_greedy_full(model, prompt))


@functools.cache
def _peft_reference(base_path: str, adapter: str | None) -> Any:
    """PEFT serving one adapter (float32), or the base model. One PeftModel per adapter: PEFT wants
    every adapter of one model with target_parameters to target the same tensors. Loaded once per
    (base, adapter): the parametrizations in other dtypes and kernels score the same reference."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    return base if adapter is None else PeftModel.from_pretrained(base, adapter).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_batch_matches_peft(
    arch: str,
    cpu_kernel: str,
    dtype: str,
    moe_models: dict[str, tuple[str, Any]],
    moe_adapters: dict[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Base requests and three adapters of ranks 8, 4 and 16 (on attention, on the experts' stacked
    tensors as PEFT's target_parameters trains them, on Qwen2-MoE's shared expert) interleaved in one
    batch over two slots, the linears through the C LoRA kernel (its calls counted) or the torch ops,
    against PEFT in float32."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    kernel_dtypes = []
    run = lora_cpu.run
    monkeypatch.setattr(lora_cpu, "run", lambda *args: kernel_dtypes.append(args[0].dtype) or run(*args))
    path, hf = moe_models[arch]
    adapters = moe_adapters[arch]
    prompts = _prompts(hf.config.vocab_size, seed=1)
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=32, max_num_batched_tokens=32)
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
    references = {name: _peft_reference(path, adapters[name] if name else None) for name in [None, *adapters]}
    for out, (name, i) in zip(outputs, cases):
        peft = references[name]
        if dtype == "float32":
            _check_exact(out, prompts[i], _ref_greedy(peft, prompts[i]), _ref_logprobs(peft, prompts[i]))
        else:
            peft_bf16 = bf16_twin(peft)
            check_bf16_routed(
                out,
                prompts[i],
                lambda ids, peft=peft: _ref_logprobs(peft, ids),
                lambda ids, peft_bf16=peft_bf16: _ref_logprobs(peft_bf16, ids),
                f"adapter {name}, prompt {i}",
            )
        if name is not None:  # each adapter moves its logprobs far beyond any bound above
            moved = (_ref_logprobs(peft, prompts[i]) - _ref_logprobs(references[None], prompts[i])).abs().max().item()
            assert moved > 1.0, f"adapter {name} hardly changes the model: {moved:.3f}"


def test_expert_adapter_reaches_only_the_routed_tokens(
    moe_models: dict[str, tuple[str, Any]], tmp_path: Any
) -> None:
    """An adapter on one expert of the last layer alone (the others' B zero) changes exactly the tokens
    routed to it, in PEFT, and ours match PEFT's there and everywhere else."""
    path, hf = moe_models["qwen3_moe"]
    folder = str(tmp_path / "one_expert")
    save_peft_adapter(
        hf,
        folder,
        seed=5,
        base_name=path,
        r=4,
        lora_alpha=8,
        target_modules=[],
        target_parameters=["experts.gate_up_proj"],
        layers_to_transform=[1],
    )
    from safetensors.torch import load_file, save_file

    file = f"{folder}/adapter_model.safetensors"
    tensors = load_file(file)
    num = hf.config.num_experts
    for key, tensor in tensors.items():
        if "lora_B" in key:  # columns j * E + e belong to expert e: keep expert 3's only
            keep = torch.zeros(num, dtype=torch.bool)
            keep[3] = True
            tensor[:, ~keep.repeat(tensor.shape[1] // num)] = 0
    save_file(tensors, file)
    peft = _peft_reference(path, folder)
    prompt = _prompts(hf.config.vocab_size)[-1]
    with torch.no_grad():
        captured: dict[str, Any] = {}
        gate = hf.model.layers[1].mlp.gate
        handle = gate.register_forward_hook(lambda m, i, o: captured.update(ids=o[2]))
        hf(torch.tensor([prompt]))
        handle.remove()
    routed = (captured["ids"] == 3).any(-1)
    moved = (_logprobs(peft, prompt) - _logprobs(hf, prompt)).abs().max(-1).values > 1e-6
    # The adapted layer is the last one: a position's logits move exactly where its token went to expert 3.
    assert routed.any() and not routed.all() and torch.equal(moved, routed)
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=4)
    out = llm.generate(
        [{"prompt_token_ids": prompt}], _params(), lora_request=LoRARequest("one", 1, folder), use_tqdm=False
    )[0]
    _check_exact(out, prompt, hf_greedy_full(peft, prompt), _logprobs(peft, prompt))


def test_expert_adapters_are_refused_where_no_experts_take_them(
    moe_models: dict[str, tuple[str, Any]], moe_adapters: dict[str, dict[str, str]], tiny_model: Any
) -> None:
    """On a dense model an adapter's expert tensors are refused naming the module and the
    architecture; with --lora-target-modules leaving out `experts` they are skipped."""
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_lora_rank=16)
    adapter = moe_adapters["mixtral"]["attn_experts_r8"]
    with pytest.raises(LoRAAdapterError, match=r"experts.*LlamaForCausalLM"):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}],
            _params(),
            lora_request=LoRARequest("x", 1, adapter),
            use_tqdm=False,
        )


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_per_expert_module_adapters_match_peft(
    arch: str, moe_models: dict[str, tuple[str, Any]], tmp_path: Any
) -> None:
    """Adapters saved on nn.Linear experts apply as PEFT applies them on the stacked tensors (gate and
    up stacked at twice the rank), beside base requests. PEFT converts Mixtral's itself; Qwen2-MoE's
    per-expert weights it leaves out (no LoRA on the experts), so its reference is the same adapter
    converted by hand to PEFT's target_parameters form."""
    path, hf = moe_models[arch]
    folder = str(tmp_path / "per_expert")
    save_per_expert_adapter(hf, folder, path)
    reference = folder
    if arch == "qwen2_moe":
        reference = str(tmp_path / "converted")
        as_target_parameters(folder, reference, hf)
    peft = _peft_reference(path, reference)
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8)
    prompts = _prompts(hf.config.vocab_size, seed=2)
    request = LoRARequest("old", 1, folder)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts + prompts],
        _params(),
        lora_request=[request] * len(prompts) + [None] * len(prompts),
        use_tqdm=False,
    )
    for i, prompt in enumerate(prompts + prompts):
        model = peft if i < len(prompts) else hf
        _check_exact(outputs[i], prompt, hf_greedy_full(model, prompt), _logprobs(model, prompt))
    moved = (_logprobs(peft, prompts[-1]) - _logprobs(hf, prompts[-1])).abs().max()
    assert moved > 1.0


def _peft_scaled(base_path: str, adapters: dict[str, tuple[str, float]]) -> Any:
    """PEFT with every named adapter active at once, each LoRA term's scaling times its weight: the sum of
    weighted adapters, which is what a scaled adapter (one entry) or a linear mix computes."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    (first, (first_path, _)), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, first_path, adapter_name=first)
    for name, (path, _) in rest:
        model.load_adapter(path, adapter_name=name)
    model.base_model.set_adapter(list(adapters))
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict):
            for name, (_, weight) in adapters.items():
                if name in scaling:
                    scaling[name] *= weight
    return model.eval()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_scaled_and_mixed_expert_adapters_match_peft(
    arch: str, moe_models: dict[str, tuple[str, Any]], tmp_path: Any
) -> None:
    """A per-request scale and a two-adapter mix reach the expert LoRA terms too (not only attention):
    in one batch with the plain adapter and the base model, against PEFT with the same weights."""
    path, hf = moe_models[arch]
    kwargs = ADAPTERS["attn_experts_r8"]
    folders = {name: str(tmp_path / name) for name in ("a", "b")}
    for seed, folder in enumerate(folders.values()):
        save_peft_adapter(hf, folder, seed=90 + seed, base_name=path, **kwargs)
    a, b = (LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(folders.items()))
    scaled = LoRARequest("a", 1, folders["a"], scale=0.5)
    mix = LoRARequest.mixed([(a, 0.7), (b, -0.4)], lora_int_id=3)
    prompts = _prompts(hf.config.vocab_size, seed=3)[:2]
    cases = [(lora, i) for lora in (None, a, scaled, mix) for i in range(len(prompts))]
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in cases],
        _params(),
        [lora for lora, _ in cases],
        use_tqdm=False,
    )
    references = [
        _peft_reference(path, None),
        _peft_reference(path, folders["a"]),
        _peft_scaled(path, {"a": (folders["a"], 0.5)}),
        _peft_scaled(path, {"a": (folders["a"], 0.7), "b": (folders["b"], -0.4)}),
    ]
    for number, (out, (_, i)) in enumerate(zip(outputs, cases, strict=True)):
        peft = references[number // len(prompts)]
        _check_exact(out, prompts[i], hf_greedy_full(peft, prompts[i]), _logprobs(peft, prompts[i]))
    plain, half = (_logprobs(references[k], prompts[0]) for k in (1, 2))
    assert (plain - half).abs().max().item() > 0.1  # the scale changes the expert-adapted model


@needs_triton
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_batch_matches_peft_through_triton(
    arch: str,
    moe_models: dict[str, tuple[str, Any]],
    moe_adapters: dict[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mixed batch with the attention (and dense MLP) LoRA terms through the Triton kernels under
    the interpreter, float32 (expert terms run the torch ops by design), against PEFT."""
    path, hf = moe_models[arch]
    prompt = _prompts(hf.config.vocab_size, seed=1)[-1][:9]
    check_mixed_batch_through_triton(monkeypatch, path, moe_adapters[arch], prompt)
