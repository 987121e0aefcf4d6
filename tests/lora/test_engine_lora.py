"""Multi-LoRA through the engine vs PEFT: exact greedy tokens, close logprobs, mixed batches, bad adapters."""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

import pytest
import torch
from support.parity import memoized, peft_logprobs, peft_model

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.errors import LoRAAdapterError
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest

LLAMA_ADAPTERS: dict[str, dict[str, Any]] = {
    "all7_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]),
    "qv_rslora_r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "up_only_r16": dict(r=16, lora_alpha=16, target_modules=["up_proj"]),
    "attn_patterns": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          rank_pattern={"k_proj": 2, "layers.1.self_attn.o_proj": 4},
                          alpha_pattern={"q_proj": 32}),
    "mlp_layer1": dict(r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"],
                       layers_to_transform=[1]),
    "lora_bias": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"], lora_bias=True),
}
NUM_NEW = 8


@pytest.fixture(scope="module")
def llama_adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("llama-adapters")
    base = hf_model(path)
    paths = {}
    for i, (name, kwargs) in enumerate(LLAMA_ADAPTERS.items()):
        paths[name] = str(root / name)
        save_peft_adapter(base, paths[name], seed=50 + i, base_name=path, **kwargs)
    return paths


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 24, (count,),
                                                                                                 generator=g)]


def _peft_reference(base_path: str, adapters: dict[str, str], prompts: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens and prompt logprobs of every (adapter, prompt) pair from PEFT, one adapter at a time."""
    model = peft_model(base_path, adapters)
    ref: dict[str, Any] = {}
    for name in [None, *adapters]:
        for i, prompt in enumerate(prompts):
            ref[(name, i)] = memoized(model, ("run", name, tuple(prompt)), lambda: _peft_run(model, name, prompt))  # noqa: B023
    return ref


def _peft_run(model: Any, name: str | None, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if name is None:
            with model.disable_adapter():
                out, logits = model.generate(ids, **kwargs), model(ids).logits
        else:
            model.set_adapter(name)
            out, logits = model.generate(ids, **kwargs), model(ids).logits
    return out[0, len(prompt):].tolist(), torch.log_softmax(logits[0].float(), -1)


def _check_against_peft(outputs: list[Any], cases: list[tuple[str | None, int]], prompts: list[list[int]],
                        ref: dict[str, Any]) -> None:
    for out, (name, i) in zip(outputs, cases):
        tokens, logprobs = ref[(name, i)]
        assert out.outputs[0].token_ids == tokens, f"adapter {name}, prompt {i}"
        for pos in range(1, len(prompts[i])):
            ours = out.prompt_logprobs[pos][prompts[i][pos]].logprob
            assert math.isclose(ours, logprobs[pos - 1, prompts[i][pos]].item(), abs_tol=1e-4)


@pytest.mark.parametrize("max_loras,max_cpu_loras,cpu_kernel", [(6, None, "1"), (2, 3, "1"), (6, None, "0")])
def test_mixed_batch_matches_peft(tiny_model: Any, llama_adapters: dict[str, str], max_loras: int,
                                  max_cpu_loras: int | None, cpu_kernel: str, linear_backend: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CPU LoRA compute paths (the fused kernel, and the torch ops with it off) over both base
    linear paths (the C linear kernel and oneDNN) against PEFT."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    path = tiny_model("llama")
    prompts = _prompts(3)
    ref = _peft_reference(path, llama_adapters, prompts)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
              max_lora_rank=16, enable_lora_bias=True)
    requests = {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(llama_adapters.items())}
    cases = [(name, i) for name in [None, *llama_adapters] for i in range(len(prompts))]
    cases = cases[::2] + cases[1::2]  # interleave adapters and base requests in one batch
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in cases], params,
                           lora_request=[requests[n] if n else None for n, _ in cases], use_tqdm=False)
    _check_against_peft(outputs, cases, prompts, ref)
    stats = llm.engine.stats()
    if max_cpu_loras is not None:
        assert stats["lora_num_host_evictions"] > 0  # the host cache really cycled and reloaded from disk


# bf16 keeps 8 significant bits: logprobs here land within 0.011 of float32 PEFT on either path,
# while the adapters move them by 0.17 to 0.66, so a LoRA term gone wrong cannot pass.
BF16_LOGPROB_TOL = 0.03


@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_mixed_batch_in_bf16_matches_peft(tiny_model: Any, llama_adapters: dict[str, str], cpu_kernel: str,
                                          linear_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 serving, through the C kernel's bf16 path or the torch ops, against PEFT in float32 scoring
    the same tokens: every prompt logprob and the logprob of every generated token within bf16 noise,
    and each generated token within that noise of PEFT's greedy choice (this tiny random model has
    near-ties, which bf16 may break the other way, so greedy sequences are not compared exactly)."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    kernel_dtypes = []
    run = lora_cpu.run
    monkeypatch.setattr(lora_cpu, "run", lambda *args: kernel_dtypes.append(args[0].dtype) or run(*args))
    path = tiny_model("llama")
    prompts = _prompts(3)
    # 32-token steps: prefill chunks have segments as short as decode's, so both reach the kernel.
    llm = LLM(path, dtype="bfloat16", enable_lora=True, max_loras=6, max_lora_rank=16, enable_lora_bias=True,
              max_num_batched_tokens=32)
    requests = {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(llama_adapters.items())}
    cases = [(name, i) for name in [None, *llama_adapters] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in cases], params,
                           lora_request=[requests[n] if n else None for n, _ in cases], use_tqdm=False)
    assert set(kernel_dtypes) == ({torch.bfloat16} if cpu_kernel == "1" and lora_cpu.kernel_available() else set())
    peft = peft_model(path, llama_adapters)
    for out, (name, i) in zip(outputs, cases):
        completion, num_prompt = out.outputs[0], len(prompts[i])
        ids = prompts[i] + list(completion.token_ids)
        assert out.prompt_logprobs is not None and completion.logprobs is not None
        ours = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, num_prompt)]
        ours += [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]
        reference = peft_logprobs(peft, name, ids)[:-1]
        theirs = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        errors = (torch.tensor(ours, dtype=torch.float32) - theirs).abs()
        assert errors.max().item() <= BF16_LOGPROB_TOL, f"adapter {name}, prompt {i}: {errors.max().item():.4f}"
        gaps = reference[num_prompt - 1 :].max(-1).values - theirs[num_prompt - 1 :]
        assert gaps.max().item() <= BF16_LOGPROB_TOL, f"adapter {name}, prompt {i}: a token PEFT ranks far below"


def test_gpt2_conv1d_adapter_matches_peft(tiny_model: Any, hf_model: Any, tmp_path: Any) -> None:
    path = tiny_model("gpt2")
    adapter = str(tmp_path / "gpt2-lora")
    save_peft_adapter(hf_model(path), adapter, seed=9, base_name=path, r=8, lora_alpha=16,
                      target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    prompts = _prompts(2, seed=3)
    ref = _peft_reference(path, {"g": adapter}, prompts)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    cases = [("g", 0), (None, 1), ("g", 1), (None, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
    lora = LoRARequest("g", 1, adapter)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in cases], params,
                           lora_request=[lora if n else None for n, _ in cases], use_tqdm=False)
    _check_against_peft(outputs, cases, prompts, ref)


def test_mixed_batch_equals_each_alone(tiny_model: Any, llama_adapters: dict[str, str]) -> None:
    path = tiny_model("llama")
    names = ["all7_r8", "qv_rslora_r4", "up_only_r16", "mlp_layer1"]
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    requests = [LoRARequest(n, i + 1, llama_adapters[n]) for i, n in enumerate(names)] + [None]
    prompts = _prompts(len(requests), seed=4)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=NUM_NEW, ignore_eos=True) for i in range(5)]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests,
                            use_tqdm=False)
    for p, sp, lora, out in zip(prompts, params, requests, together):
        alone = llm.generate({"prompt_token_ids": p}, sp, lora_request=lora, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_new_weights_under_same_name_never_reuse_stale_kv(tiny_model: Any, hf_model: Any, tmp_path: Any) -> None:
    path = tiny_model("llama")
    first, second = str(tmp_path / "v1"), str(tmp_path / "v2")
    for seed, out in ((1, first), (2, second)):
        save_peft_adapter(hf_model(path), out, seed=seed, base_name=path, r=8, lora_alpha=16,
                          target_modules=["q_proj", "k_proj", "v_proj"])
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4)
    prompt = {"prompt_token_ids": _prompts(1, seed=8)[0] * 3}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    llm.generate(prompt, params, lora_request=LoRARequest("same", 1, first), use_tqdm=False)
    assert llm.remove_lora(1)
    reloaded = llm.generate(prompt, params, lora_request=LoRARequest("same", 1, second), use_tqdm=False)[0]
    fresh = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4)
    expected = fresh.generate(prompt, params, lora_request=LoRARequest("same", 1, second), use_tqdm=False)[0]
    assert reloaded.outputs[0].token_ids == expected.outputs[0].token_ids


def _edit_config(src: str, dst: str, **changes: Any) -> str:
    import json

    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "adapter_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return dst


def test_bad_adapters_fail_alone(tiny_model: Any, llama_adapters: dict[str, str], tmp_path: Any) -> None:
    path = tiny_model("llama")
    good = llama_adapters["qv_rslora_r4"]
    bad = {
        "greater than max_lora_rank": _edit_config(llama_adapters["all7_r8"], str(tmp_path / "big"), r=64),
        # vLLM's texts, which clients and ported tests match.
        # use_dora without the magnitude vectors of a DoRA checkpoint
        "no DoRA magnitude vector": _edit_config(good, str(tmp_path / "dora"), use_dora=True),
        "only supports modules_to_save being None": _edit_config(
            good, str(tmp_path / "mts"), modules_to_save=["score"]
        ),
        "Adapter bias cannot be used without bias_enabled": _edit_config(good, str(tmp_path / "bias"), bias="all"),
        "peft_type": _edit_config(good, str(tmp_path / "ia3"), peft_type="IA3"),
    }
    no_weights = shutil.copytree(good, str(tmp_path / "noweights"))
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    bad["weights"] = no_weights
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, (message, adapter) in enumerate(bad.items()):
        with pytest.raises(LoRAAdapterError, match=message):
            llm.generate("hello", params, lora_request=LoRARequest(f"bad{i}", 100 + i, adapter), use_tqdm=False)
        out = llm.generate("hello", params, lora_request=LoRARequest("good", 1, good), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3
    assert [r.lora_name for r in llm.list_loras()] == ["good"]


def test_a_dropped_engine_frees_its_adapters_at_once(tiny_model: Any, llama_adapters: dict[str, str]) -> None:
    """No reference cycle holds the adapters: dropping the engine frees them without a collector pass."""
    import gc

    from loraserve.lora.lora_model import LoRAModel

    def num_live_adapters() -> int:
        return sum(isinstance(obj, LoRAModel) for obj in gc.get_objects())

    names = ["all7_r8", "qv_rslora_r4", "up_only_r16"]
    gc.collect()
    gc.disable()
    try:
        before = num_live_adapters()
        # One slot and two host entries: both tiers evict (their hooks run) while the three take turns.
        llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
        loras = [LoRARequest(name, i + 1, llama_adapters[name]) for i, name in enumerate(names)]
        llm.generate(_prompts(3), SamplingParams(max_tokens=2), lora_request=loras, use_tqdm=False)
        assert num_live_adapters() > before
        del llm
        assert num_live_adapters() == before
    finally:
        gc.enable()
