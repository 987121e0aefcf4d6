"""Native Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE against transformers: the models and their routing.

Tiny random models shaped like the real configs (tests/support/tiny_moe.py, built in conftest.py):
greedy tokens equal transformers' `generate` and prompt logprobs match in float32, from the per-expert
checkpoint transformers saves and from the stacked layout it holds in memory; in bfloat16 every logprob
stays within bf16 noise of float32 transformers; each config feature matters on the test prompts; the
experts run batched by expert and the router normalises as configured. Adapters on these models are
in test_moe_adapters.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support.parity import check_bf16_routed, hf_greedy_full
from support.tiny_moe import MOE_ARCHS, moe_config, save_fused_layout
from test_gemma import _check_exact, _logprobs, _params, _prompts
from transformers import AutoModelForCausalLM

from loraserve import LLM
from loraserve.layers import fused_moe
from loraserve.layers.fused_moe import FusedMoE, route

NATIVE = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def _serve_and_check(path: str, hf: Any, dtype: str = "float32") -> None:
    llm = LLM(path, dtype=dtype, max_num_batched_tokens=64)
    assert type(llm.engine.model).__name__ == NATIVE[hf.config.model_type]
    prompts = _prompts(hf.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    if dtype == "float32":
        for prompt, out in zip(prompts, outputs):
            _check_exact(out, prompt, hf_greedy_full(hf, prompt), _logprobs(hf, prompt))
        return
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        check_bf16_routed(
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
