"""Native Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE against transformers and PEFT.

Tiny random models shaped like the real configs (tests/support/tiny_moe.py): greedy tokens equal
transformers' `generate` and prompt logprobs match in float32, from the per-expert checkpoint
transformers saves and from the stacked layout it holds in memory; in bfloat16 every logprob stays
within bf16 noise of float32 transformers; the experts run batched by expert; PEFT adapters of
different ranks in one mixed batch with fewer slots than adapters, through the C LoRA kernel and the
torch ops, in both dtypes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support.parity import BF16_FACTOR, BF16_FLOOR
from support.tiny_moe import MOE_ARCHS, moe_config, save_fused_layout, save_tiny_moe
from support.triton_lora import check_mixed_batch_through_triton, needs_triton
from test_gemma import _check_exact, _logprobs, _params, _prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraserve import LLM
from loraserve.demo.random_model import save_peft_adapter
from loraserve.errors import LoRAAdapterError
from loraserve.layers import fused_moe
from loraserve.layers.fused_moe import FusedMoE, route
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest

NATIVE = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
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
def moe_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, tuple[str, Any]]:
    """arch -> (folder, the float32 HF model) for every MoE family."""
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    models = {}
    for arch in MOE_ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        models[arch] = (path, save_tiny_moe(path, arch, tokenizer_dir, vocab_size))
    return models


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


def _peft_reference(base_path: str, adapter: str | None) -> Any:
    """PEFT serving one adapter (float32), or the base model. One PeftModel per adapter: PEFT wants
    every adapter of one model with target_parameters to target the same tensors."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    return base if adapter is None else PeftModel.from_pretrained(base, adapter).eval()


def _greedy(model: Any, prompt: list[int], num_new: int = 8) -> list[int]:
    """Greedy tokens by full forwards (transformers' `generate` with min_new_tokens masks the EOS token,
    which ignore_eos serving may pick, and its cached decode rounds otherwise than its full forward)."""
    ids = list(prompt)
    for _ in range(num_new):
        ids.append(int(_logprobs(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def _check_bf16(out: Any, prompt: list[int], reference_of: Any, bf16_of: Any, what: str) -> None:
    """test_gemma's bf16 check, allowing one routing flip per sequence: where a token's k-th and
    (k+1)-th experts nearly tie, bf16 rounding (ours or transformers', each in other places) may swap
    them, a jump in that token's output however close the rest is. So every token's logprob error and
    generated-token gap stay within BF16_FACTOR times transformers' own worst bf16 error on the
    sequence but at most one, and the median error within BF16_FACTOR times transformers' median."""
    completion = out.outputs[0]
    ids = prompt + list(completion.token_ids)
    ours = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(prompt))]
    ours += [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
    rows, nxt = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    reference = reference_of(ids)[:-1]
    theirs = reference[rows, nxt]
    hf_errors = (bf16_of(ids)[:-1][rows, nxt] - theirs).abs()
    tol = max(BF16_FLOOR, BF16_FACTOR * hf_errors.max().item())
    errors = (torch.tensor(ours, dtype=torch.float32) - theirs).abs()
    gaps = reference[len(prompt) - 1 :].max(-1).values - theirs[len(prompt) - 1 :]
    median_tol = max(BF16_FLOOR, BF16_FACTOR * hf_errors.median().item())
    assert int((errors > tol).sum()) + int((gaps > tol).sum()) <= 1, (
        f"{what}: errors {errors.max():.4f}, gaps {gaps.max():.4f}, bound {tol:.4f}"
    )
    assert errors.median() <= median_tol, f"{what}: median error {errors.median():.4f} > {median_tol:.4f}"


def _serve_and_check(path: str, hf: Any, dtype: str = "float32") -> None:
    llm = LLM(path, dtype=dtype, max_num_batched_tokens=64)
    assert type(llm.engine.model).__name__ == NATIVE[hf.config.model_type]
    prompts = _prompts(hf.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    if dtype == "float32":
        for prompt, out in zip(prompts, outputs):
            _check_exact(out, prompt, _greedy(hf, prompt), _logprobs(hf, prompt))
        return
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        _check_bf16(
            out, prompt, lambda ids: _logprobs(hf, ids), lambda ids: _logprobs(hf_bf16, ids), f"prompt {i}"
        )


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_float32_matches_transformers(
    arch: str, moe_models: dict[str, tuple[str, Any]], linear_backend: str
) -> None:
    """From the per-expert checkpoint transformers' save_pretrained writes (Mixtral's under
    `block_sparse_moe.experts.N.w1/w2/w3`, the others' `mlp.experts.N.gate_proj/up_proj/down_proj`)."""
    path, hf = moe_models[arch]
    _serve_and_check(path, hf)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_stacked_expert_layout_loads(
    arch: str, moe_models: dict[str, tuple[str, Any]], tmp_path: Any, tokenizer_dir: str
) -> None:
    """A checkpoint holding transformers' stacked `mlp.experts.gate_up_proj` / `down_proj` serves the same."""
    _, hf = moe_models[arch]
    path = str(tmp_path / "stacked")
    save_fused_layout(hf, path, tokenizer_dir)
    _serve_and_check(path, hf)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bfloat16_within_bf16_noise_of_transformers(
    arch: str, moe_models: dict[str, tuple[str, Any]]
) -> None:
    path, hf = moe_models[arch]
    _serve_and_check(path, hf, "bfloat16")


@pytest.mark.parametrize(
    ("arch", "change"),
    [
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("qwen2_moe", {"norm_topk_prob": True}),
        ("qwen2_moe", {"mlp_only_layers": []}),
        ("olmoe", {"clip_qkv": None}),
        ("olmoe", {"num_experts_per_tok": 2}),
        ("mixtral", {"sliding_window": None}),
    ],
)
def test_the_tiny_models_exercise_each_feature(
    arch: str, change: dict[str, Any], moe_models: dict[str, tuple[str, Any]]
) -> None:
    """The parity above means something only if each config feature changes transformers' outputs on
    these prompts."""
    _, hf = moe_models[arch]
    prompt = _prompts(hf.config.vocab_size)[-1]
    config = moe_config(arch, hf.config.vocab_size)
    for key, value in change.items():
        setattr(config, key, value)
    other = AutoModelForCausalLM.from_config(config).eval()
    missing, _ = other.load_state_dict(hf.state_dict(), strict=False)
    assert all(".mlp." in name for name in missing)  # only a dense MLP that became sparse starts fresh
    assert (_logprobs(other, prompt) - _logprobs(hf, prompt)).abs().max() > 0.05


def _naive_moe(experts: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    size = experts.intermediate_size
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = experts.gate_up_proj[e] @ x[t]
            hidden = torch.nn.functional.silu(gate_up[:size]) * gate_up[size:]
            out[t] += weights[t, j] * (experts.down_proj[e] @ hidden)
    return out


def test_experts_run_batched_by_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """One gate_up and one down product per expert that has tokens, whatever the token count, and the
    sum of each token's k weighted experts."""
    torch.manual_seed(0)
    experts = FusedMoE(8, 16, 12, torch.float32)
    experts.gate_up_proj.data.normal_()
    experts.down_proj.data.normal_()
    x = torch.randn(100, 16)
    weights, ids = route(torch.randn(100, 8), 3, True, torch.float32)
    products = []
    mm = torch.mm
    monkeypatch.setattr(fused_moe.torch, "mm", lambda *a, **k: products.append(a[0].shape[0]) or mm(*a, **k))
    out = experts(x, weights, ids)
    assert len(products) == 2 * len(set(ids.flatten().tolist())) and sum(products) == 2 * 300
    torch.testing.assert_close(out, _naive_moe(experts, x, weights, ids), rtol=1e-4, atol=1e-4)


def test_routing_normalises_as_configured() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, False, torch.float32)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    renormed, _ = route(logits, 2, True, torch.bfloat16)
    assert renormed.dtype == torch.bfloat16
    torch.testing.assert_close(renormed.float(), probs[:, :2] / probs[:, :2].sum(), rtol=1e-2, atol=1e-2)


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
            _check_exact(out, prompts[i], _greedy(peft, prompts[i]), _logprobs(peft, prompts[i]))
        else:
            peft_bf16 = copy.deepcopy(peft).to(torch.bfloat16)
            _check_bf16(
                out,
                prompts[i],
                lambda ids, peft=peft: _logprobs(peft, ids),
                lambda ids, peft_bf16=peft_bf16: _logprobs(peft_bf16, ids),
                f"adapter {name}, prompt {i}",
            )
        if name is not None:  # each adapter moves its logprobs far beyond any bound above
            moved = (_logprobs(peft, prompts[i]) - _logprobs(references[None], prompts[i])).abs().max().item()
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
    _check_exact(out, prompt, _greedy(peft, prompt), _logprobs(peft, prompt))


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


def _save_per_expert_adapter(hf: Any, folder: str, base_path: str, rank: int = 4) -> None:
    """An adapter as PEFT saved it on older transformers, whose experts were nn.Linear modules
    (Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`, the others' `mlp.experts.N.gate_proj/...`),
    with q_proj beside them; random values (this transformers cannot train that layout)."""
    import json
    import os

    from safetensors.torch import save_file

    config = hf.config
    mixtral = config.model_type == "mixtral"
    block, leaves = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if mixtral
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    num = config.num_local_experts if mixtral else config.num_experts
    hidden = config.hidden_size
    size = config.intermediate_size if mixtral else config.moe_intermediate_size
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{layer}"
        for e in range(0 if layer in (getattr(config, "mlp_only_layers", None) or []) else num):
            for leaf, (fan_in, fan_out) in zip(leaves, [(hidden, size), (hidden, size), (size, hidden)]):
                key = f"{prefix}.{block}.experts.{e}.{leaf}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
        q = f"{prefix}.self_attn.q_proj"
        tensors[f"{q}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.2
        tensors[f"{q}.lora_B.weight"] = torch.randn(hidden, rank, generator=g) * 0.2
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, f"{folder}/adapter_model.safetensors")
    adapter_config = dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=rank,
        lora_alpha=2 * rank,
        base_model_name_or_path=base_path,
        target_modules=["q_proj", *leaves],
    )
    with open(f"{folder}/adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(adapter_config, f)


def _as_target_parameters(folder: str, out: str, hf: Any, rank: int = 4) -> None:
    """The per-expert adapter in `folder` rewritten as PEFT's target_parameters adapter on the stacked
    tensors, as PEFT itself converts Mixtral's: per expert A = [A_gate; A_up], B block-diagonal (rank
    2r, alpha 2 alpha: the same scaling); lora_A rows e * rank + j, lora_B columns j * E + e."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{folder}/adapter_model.safetensors")
    with open(f"{folder}/adapter_config.json", encoding="utf-8") as f:
        config = json.load(f)
    num, size = hf.config.num_experts, hf.config.moe_intermediate_size
    converted = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.lora_A.weight" not in tensors:
            continue
        gate_up_a, gate_up_b, down_a, down_b = [], [], [], []
        for e in range(num):
            a_g, b_g = (
                tensors[f"{prefix}.{e}.gate_proj.lora_A.weight"],
                tensors[f"{prefix}.{e}.gate_proj.lora_B.weight"],
            )
            a_u, b_u = (
                tensors[f"{prefix}.{e}.up_proj.lora_A.weight"],
                tensors[f"{prefix}.{e}.up_proj.lora_B.weight"],
            )
            gate_up_a.append(torch.cat([a_g, a_u]))
            b = torch.zeros(2 * size, 2 * rank)
            b[:size, :rank], b[size:, rank:] = b_g, b_u
            gate_up_b.append(b)
            down_a.append(tensors[f"{prefix}.{e}.down_proj.lora_A.weight"])
            down_b.append(tensors[f"{prefix}.{e}.down_proj.lora_B.weight"])
        converted[f"{prefix}.base_layer.lora_A.weight"] = torch.cat(gate_up_a)
        converted[f"{prefix}.base_layer.lora_B.weight"] = torch.stack(gate_up_b, -1).flatten(1)
        converted[f"{prefix}.lora_A.weight"] = torch.cat(down_a)
        converted[f"{prefix}.lora_B.weight"] = torch.stack(down_b, -1).flatten(1)
    os.makedirs(out, exist_ok=True)
    save_file(converted, f"{out}/adapter_model.safetensors")
    config |= dict(
        target_modules=["q_proj"],
        target_parameters=["experts.down_proj", "experts.gate_up_proj"],
        rank_pattern={r".*\.gate_up_proj": 2 * rank},
        alpha_pattern={r".*\.gate_up_proj": 4 * rank},
    )
    with open(f"{out}/adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)


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
    _save_per_expert_adapter(hf, folder, path)
    reference = folder
    if arch == "qwen2_moe":
        reference = str(tmp_path / "converted")
        _as_target_parameters(folder, reference, hf)
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
        _check_exact(outputs[i], prompt, _greedy(model, prompt), _logprobs(model, prompt))
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
        _check_exact(out, prompts[i], _greedy(peft, prompts[i]), _logprobs(peft, prompts[i]))
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
