"""LoRA on the transformers backend vs PEFT: mixed batches (the base model and three adapters of different
ranks, max_loras=2), float32 and bfloat16, the C LoRA kernel and the torch ops, on tiny random models of
architectures with no native implementation (shaped like their real configs: GQA, head_dim != hidden /
heads, sliding windows shorter than the prompts), plus Phi-3's fused projections and GPT-2's Conv1D.

The oracle is PEFT on the float32 HF model scoring the tokens we generated (teacher forcing): each
logprob within the dtype's noise, and each generated token within that noise of PEFT's argmax.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import transformers
from support.fused_adapters import split_to_fused
from support.parity import peft_logprobs, peft_model
from support.stack_calls import count_lora_kernel_steps
from support.triton_lora import check_mixed_batch_through_triton, needs_triton

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter, save_random_model
from loraserve.errors import LoRAAdapterError
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
NUM_NEW = 6
# float32: the paged attention, packed linears and LoRA kernels reorder sums only. bf16 (8 significant
# bits): measured within 0.035 of float32 PEFT, while each adapter moves logprobs by more than 2 TOL
# (checked), so a LoRA term gone wrong cannot pass.
TOL = {"float32": 1e-4, "bfloat16": 0.05}


def _configs(vocab: int) -> dict[str, tuple[Any, list[str]]]:
    """Architecture -> (config, the modules its adapters target)."""
    return {
        "gemma": (transformers.GemmaConfig(vocab_size=vocab, head_dim=32, **SHAPE), ATTN + MLP),
        "gemma2": (
            transformers.Gemma2Config(
                vocab_size=vocab,
                head_dim=32,
                sliding_window=4,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=20.0,
                final_logit_softcapping=15.0,
                **SHAPE,
            ),
            ATTN + MLP,
        ),
        "gemma3_text": (
            transformers.Gemma3TextConfig(
                vocab_size=vocab,
                head_dim=32,
                sliding_window=4,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"],
                **SHAPE,
            ),
            ATTN + MLP,
        ),
        "phi3": (
            transformers.Phi3Config(vocab_size=vocab, pad_token_id=0, **SHAPE),
            ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        ),
        "olmo2": (transformers.Olmo2Config(vocab_size=vocab, pad_token_id=0, **SHAPE), ATTN + MLP),
        "granite": (
            transformers.GraniteConfig(
                vocab_size=vocab,
                embedding_multiplier=2.0,
                residual_multiplier=0.5,
                attention_multiplier=0.2,
                logits_scaling=2.0,
                **SHAPE,
            ),
            ATTN + MLP,
        ),
        "cohere": (
            transformers.CohereConfig(vocab_size=vocab, logit_scale=0.5, use_qk_norm=False, **SHAPE),
            ATTN + MLP,
        ),
        "stablelm": (
            transformers.StableLmConfig(vocab_size=vocab, partial_rotary_factor=0.5, **SHAPE),
            ATTN + MLP,
        ),
        "gpt_neox": (
            transformers.GPTNeoXConfig(
                vocab_size=vocab,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=256,
                rotary_pct=0.5,
                bos_token_id=1,
                eos_token_id=2,
            ),
            ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
        ),
    }


def _adapter_kwargs(targets: list[str]) -> list[dict[str, Any]]:
    """Three adapters of different ranks and target sets (one with per-module ranks)."""
    return [
        dict(r=8, lora_alpha=16, target_modules=targets),
        dict(r=4, lora_alpha=8, use_rslora=True, target_modules=[targets[0], targets[2]]),
        dict(r=16, lora_alpha=16, target_modules=targets[-2:], rank_pattern={targets[-1]: 2}),
    ]


@pytest.fixture(scope="module")
def built(tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """arch -> (model folder, {adapter name: folder}), each built once per module."""
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    cache: dict[str, tuple[str, dict[str, str]]] = {}

    def build(arch: str) -> tuple[str, dict[str, str]]:
        if arch not in cache:
            config, targets = _configs(vocab)[arch]
            root = tmp_path_factory.mktemp(f"hf-lora-{arch}")
            path = str(root / "model")
            save_random_model(path, config, seed=1234)
            for name in os.listdir(tokenizer_dir):
                shutil.copy(os.path.join(tokenizer_dir, name), path)
            base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            adapters = {}
            for i, kwargs in enumerate(_adapter_kwargs(targets)):
                adapters[f"a{i}"] = str(root / f"a{i}")
                save_peft_adapter(base, adapters[f"a{i}"], seed=60 + i, base_name=path, **kwargs)
            cache[arch] = (path, adapters)
        return cache[arch]

    return build


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 500, (int(n),), generator=g).tolist()
        for n in torch.randint(6, 20, (count,), generator=g)
    ]


def _serve_and_check(
    path: str,
    adapters: dict[str, str],
    dtype: str,
    peft_adapters: dict[str, str] | None = None,
    **llm_kwargs: Any,
) -> None:
    """Every adapter and the base model on every prompt in one mixed batch, checked against PEFT."""
    prompts = _prompts(2)
    llm = LLM(
        path,
        dtype=dtype,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_batched_tokens=32,
        **llm_kwargs,
    )
    requests = {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(adapters.items())}
    cases = [(name, i) for name in [None, *adapters] for i in range(len(prompts))]
    cases = cases[::2] + cases[1::2]  # adapters and base requests interleaved in the batch
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in cases],
        params,
        lora_request=[requests[n] if n else None for n, _ in cases],
        use_tqdm=False,
    )
    peft = peft_model(path, peft_adapters or adapters)
    tol = TOL[dtype]
    for out, (name, i) in zip(outputs, cases, strict=True):
        completion, num_prompt = out.outputs[0], len(prompts[i])
        ids = prompts[i] + list(completion.token_ids)
        ours = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, num_prompt)]
        ours += [
            position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)
        ]
        reference = peft_logprobs(peft, name, ids)[:-1]
        targets = torch.tensor(ids[1:])
        theirs = reference[torch.arange(len(ids) - 1), targets]
        error = (torch.tensor(ours) - theirs).abs().max().item()
        assert error <= tol, f"adapter {name}, prompt {i}: logprob error {error:.3g} > {tol}"
        gaps = reference[num_prompt - 1 :].max(-1).values - theirs[num_prompt - 1 :]
        assert gaps.max().item() <= tol, f"adapter {name}, prompt {i}: a generated token PEFT ranks lower"
        if name is not None:  # the adapter matters far beyond the tolerance, so a lost LoRA term fails
            base = peft_logprobs(peft, None, ids)[:-1][torch.arange(len(ids) - 1), targets]
            assert (base - theirs).abs().max().item() > 2 * tol, f"adapter {name} barely changes the output"


@pytest.mark.parametrize("cpu_kernel", ["1", "0"], ids=["c_kernel", "lora_torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch", ["gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "cohere", "stablelm", "gpt_neox"]
)
def test_mixed_batch_matches_peft(
    built: Any, arch: str, dtype: str, cpu_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    kernel_calls = count_lora_kernel_steps(monkeypatch)  # Gemma runs natively, maybe in the C stack
    path, adapters = built(arch)
    # Phi-3 runs natively by default (tests/models/test_phi3.py); here its fused modules go through
    # the backend's HFLinear slices.
    _serve_and_check(path, adapters, dtype, model_impl="transformers" if arch == "phi3" else "auto")
    # The C kernel really ran where it was on (it serves float32 and bf16 CPU tensors), and only there.
    assert bool(kernel_calls) == (cpu_kernel == "1" and lora_cpu.kernel_available())


def test_split_qkv_and_gate_up_adapters_apply_to_phi3_fused_layers(built: Any, tmp_path: Path) -> None:
    """An adapter trained on separate q/k/v and gate/up modules (a Llama-style checkpoint) serves as
    slices of Phi-3's fused qkv_proj and gate_up_proj, like its fused equivalent does under PEFT."""
    from peft import LoraConfig, get_peft_model

    path, _ = built("phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    text = hf.config
    head_dim = text.hidden_size // text.num_attention_heads
    sizes = {
        "qkv_proj": [text.num_attention_heads * head_dim] + [text.num_key_value_heads * head_dim] * 2,
        "gate_up_proj": [text.intermediate_size] * 2,
    }
    # Train-shaped split adapters: PEFT on a Llama of the same shapes, names as Phi-3's parts.
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=text.vocab_size, **{k: v for k, v in SHAPE.items()})
    )
    split, fused = {}, {}
    for i, targets in enumerate(
        [["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"], ["k_proj", "up_proj"]]
    ):
        torch.manual_seed(80 + i)
        peft = get_peft_model(llama, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.2)
        split[f"s{i}"] = str(tmp_path / f"s{i}")
        peft.save_pretrained(split[f"s{i}"])
        llama = peft.unload()
        fused[f"s{i}"] = str(tmp_path / f"f{i}")
        split_to_fused(
            split[f"s{i}"],
            fused[f"s{i}"],
            {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
            sizes,
        )
    _serve_and_check(path, split, "float32", peft_adapters=fused, model_impl="transformers")


def test_gpt2_conv1d_on_the_transformers_backend_matches_peft(
    tiny_model: Any, hf_model: Any, tmp_path: Path
) -> None:
    """GPT-2 forced through the backend: transformers' Conv1D layers ([in, out] weights) take adapters."""
    path = tiny_model("gpt2")
    adapters = {}
    for i, (r, targets) in enumerate([(8, ["c_attn", "c_proj", "c_fc"]), (2, ["c_attn"]), (16, ["c_fc"])]):
        adapters[f"g{i}"] = str(tmp_path / f"g{i}")
        save_peft_adapter(
            hf_model(path),
            adapters[f"g{i}"],
            seed=30 + i,
            base_name=path,
            r=r,
            lora_alpha=16,
            target_modules=targets,
            fan_in_fan_out=True,
        )
    _serve_and_check(path, adapters, "float32", model_impl="transformers")


def test_adapter_on_a_module_without_lora_path_is_refused_naming_module_and_architecture(
    built: Any, tmp_path: Path
) -> None:
    path, adapters = built("gemma2")
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16)
    bad = tmp_path / "bad"
    shutil.copytree(adapters["a0"], bad)
    tensors = safetensors.torch.load_file(str(bad / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.post_attention_layernorm.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.layers.0.post_attention_layernorm.lora_B.weight"] = torch.zeros(64, 8)
    safetensors.torch.save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"post_attention_layernorm.*on Gemma2ForCausalLM"):
        llm.generate(
            {"prompt_token_ids": [3, 4, 5]},
            SamplingParams(max_tokens=1),
            lora_request=LoRARequest("bad", 1, str(bad)),
            use_tqdm=False,
        )
    # The engine still serves the good adapter.
    out = llm.generate(
        {"prompt_token_ids": [3, 4, 5]},
        SamplingParams(max_tokens=2, ignore_eos=True),
        lora_request=LoRARequest("a0", 2, adapters["a0"]),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 2


def test_architecture_with_no_lora_capable_module_is_refused_at_startup_in_one_line(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model none of whose modules can take LoRA (here: its linear layers left unconverted, as for
    module types with no LoRA path) is refused when the engine starts, naming the architecture."""
    from loraserve.models import hf_linears, transformers_fallback

    path, _ = built("olmo2")
    monkeypatch.setattr(
        transformers_fallback,
        "convert_linears",
        lambda hf, binding: hf_linears.ConvertedLinears((), frozenset(), {}),
    )
    with pytest.raises(
        ValueError,
        match=r"^--enable-lora: Olmo2ForCausalLM has no module that can take a LoRA "
        r"adapter[^\n]*$",
    ):
        LLM(path, dtype="float32", enable_lora=True)
    LLM(path, dtype="float32")  # without LoRA it serves


@needs_triton
@pytest.mark.parametrize("arch", ["phi3", "granite", "gpt_neox"])
def test_mixed_batch_matches_peft_through_triton(
    built: Any, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's targeted linears (Phi-3's fused slices, Granite's multipliers, GPT-NeoX's fused
    query_key_value) through the Triton kernels under the interpreter, float32, against PEFT."""
    path, adapters = built(arch)
    impl = "transformers" if arch == "phi3" else "auto"
    check_mixed_batch_through_triton(monkeypatch, path, adapters, _prompts(1, seed=5)[0], model_impl=impl)
