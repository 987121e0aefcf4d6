"""`--quantization int8`: a float checkpoint's linears quantized on load to Q8_0 blocks and run by the
quantized kernels, with adapters on top, and the option's errors.

The oracle for float32 is the "Q8_0 twin": the same checkpoint with every linear weight replaced by
its own Q8_0 round trip (`quantize_q8_0(W).dequantize()`, a dense float32 model), with float32
activations at two int8 levels (LORASERVE_CPU_QUANT_ACT_LEVELS=2, within amax/32512 of each value;
the default, one level, is held to the dense model by test_gguf_quantized.py): tokens equal,
logprobs within 1e-4, and adapters on top within the float32 PEFT tolerance of PEFT on the twin. For bf16 (the decode step's activations then
go to int8 per 32, as llama.cpp does) the oracle is PEFT on the original dense model in float32: the
int8 model errs about as the dense bf16 model does.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
from support.gguf_files import write_tiny_llama_gguf
from support.oracles import assert_matches_peft

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args
from loraserve.layers.linear import Linear
from loraserve.layers.quant.formats import quantize_q8_0

PROMPTS = ["the cat in the hat", "on a mat", "hello there friend"]


@pytest.fixture(autouse=True)
def two_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_CPU_QUANT_ACT_LEVELS", "2")


TARGETS = {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


def _q8_twin(path: str, out: str) -> str:
    """The checkpoint at `path` with each linear weight (the LM head too, untied) its Q8_0 round trip."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = model.config
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        config.tie_word_embeddings = False
    for name, tensor in state.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            state[name] = quantize_q8_0(tensor).dequantize()
    twin = AutoModelForCausalLM.from_config(config)
    twin.load_state_dict(state)
    twin.save_pretrained(out)
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(path, name), out)
    return out


def _quantized_linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.quant_parts is not None]


def _greedy(llm: LLM, lora: Any = None) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
def test_int8_float32_equals_its_q8_twin(arch: str, tiny_model: Any, tmp_path: Any) -> None:
    path = tiny_model(arch)
    llm = LLM(path, dtype="float32", quantization="int8")
    quantized = _quantized_linears(llm)
    assert len(quantized) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all(m.weight.numel() == 0 for m in quantized)  # no dense copy is kept
    assert {part.tensor.qtype.name for m in quantized for part in m.quant_parts or [] if part} == {"Q8_0R"}
    embedding = llm.engine.model.model.embed_tokens.weight
    assert embedding.numel() > 0 and embedding.dtype == torch.float32  # the gather stays dense
    reference = LLM(_q8_twin(path, str(tmp_path / "twin")), dtype="float32")
    assert not _quantized_linears(reference)
    for ours, want in zip(_greedy(llm), _greedy(reference), strict=True):
        assert list(ours.token_ids) == list(want.token_ids)
        for token, a, b in zip(ours.token_ids, ours.logprobs, want.logprobs, strict=True):
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


def _peft(base: str, adapter_base: str, tmp_path: Any) -> tuple[Any, Any, dict[str, str]]:
    """(PEFT on the model at `base` with adapters "attn" and "mlp", tokenizer, the adapters' paths);
    the adapters are built on `adapter_base` (same shapes)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = {}
    for seed, (adapter, modules) in enumerate(TARGETS.items()):
        paths[adapter] = str(tmp_path / adapter)
        model = AutoModelForCausalLM.from_pretrained(adapter_base, dtype=torch.float32)
        save_peft_adapter(
            model, paths[adapter], 7 + seed, adapter_base, r=4, lora_alpha=8, target_modules=modules
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(model, paths["attn"], adapter_name="attn")
    peft_model.load_adapter(paths["mlp"], adapter_name="mlp")
    return peft_model.eval(), AutoTokenizer.from_pretrained(base), paths


def _mixed_batch(llm: LLM, paths: dict[str, str]) -> tuple[list[Any], list[Any]]:
    loras = [None, LoRARequest("attn", 1, paths["attn"]), LoRARequest("mlp", 2, paths["mlp"])]
    jobs = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.generate([p for p, _ in jobs], params, lora_request=[lo for _, lo in jobs], use_tqdm=False)
    return jobs, outputs


def test_adapters_on_the_int8_base_equal_peft_on_its_twin(tiny_model: Any, tmp_path: Any) -> None:
    """float32, one mixed batch (base and two adapters at once): PEFT on the Q8_0 twin within 2e-3."""
    path = tiny_model("llama")
    peft_model, tokenizer, paths = _peft(_q8_twin(path, str(tmp_path / "twin")), path, tmp_path)
    llm = LLM(path, dtype="float32", quantization="int8", enable_lora=True, max_loras=2, max_lora_rank=4)
    assert _quantized_linears(llm)
    jobs, outputs = _mixed_batch(llm, paths)
    for (prompt, lora), output in zip(jobs, outputs, strict=True):
        out = output.outputs[0]
        logprobs = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs, strict=True)]
        ids = list(tokenizer(prompt)["input_ids"])
        assert_matches_peft(
            peft_model, lora.lora_name if lora else None, ids, list(out.token_ids), logprobs, 2e-3
        )


def _peft_errors(peft_model: Any, tokenizer: Any, jobs: list[Any], outputs: list[Any]) -> torch.Tensor:
    """|our logprob - PEFT's| of every generated token (teacher forcing, PEFT in float32)."""
    errors = []
    for (prompt, lora), output in zip(jobs, outputs, strict=True):
        ids, out = list(tokenizer(prompt)["input_ids"]), output.outputs[0]
        full = torch.tensor([ids + list(out.token_ids)])
        with torch.no_grad():
            if lora is None:
                with peft_model.disable_adapter():
                    logits = peft_model(full).logits[0]
            else:
                peft_model.set_adapter(lora.lora_name)
                logits = peft_model(full).logits[0]
        reference = torch.log_softmax(logits.float(), -1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            errors.append(abs(reference[len(ids) - 1 + i, token].item() - entry[token].logprob))
    return torch.tensor(errors)


def test_int8_in_bf16_errs_as_dense_bf16_does(tiny_model: Any, tmp_path: Any) -> None:
    """bf16, the mixed batch, against PEFT on the original dense model in float32: the int8 base errs
    about as the dense bf16 base does (bf16's own error; Q8_0's rounding adds little). A wrong block,
    scale or LoRA term moves logprobs by tenths."""
    path = tiny_model("llama")
    peft_model, tokenizer, paths = _peft(path, path, tmp_path)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=4)
    llm = LLM(path, dtype="bfloat16", quantization="int8", **lora)
    assert _quantized_linears(llm)
    ours = _peft_errors(peft_model, tokenizer, *_mixed_batch(llm, paths))
    dense = _peft_errors(peft_model, tokenizer, *_mixed_batch(LLM(path, dtype="bfloat16", **lora), paths))
    assert ours.mean().item() <= dense.mean().item() + 0.01
    assert ours.max().item() <= dense.max().item() + 0.05


def test_vllm_names_for_on_load_int8_are_taken(tiny_model: Any) -> None:
    path = tiny_model("llama")
    for name in ("tpu_int8", "rtn"):
        assert len(_quantized_linears(LLM(path, dtype="float32", quantization=name))) == 9
    assert not _quantized_linears(LLM(path, dtype="float32"))  # off by default
    assert parse_serve_args(["m", "-q", "int8"]).quantization == "int8"


@pytest.mark.parametrize("method", ["awq", "fp8", "gptq", "bitsandbytes"])
def test_other_vllm_methods_are_refused_by_name(method: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_serve_args(["m", "--quantization", method])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--quantization {method!r} is not served" in err[0]
    assert "'int8'" in err[0] and "'gguf'" in err[0]
    with pytest.raises(ValueError, match=f"quantization {method!r} is not served"):
        LLM("no-such-model", quantization=method)


def test_int8_errors_name_what_cannot_be_quantized(
    tiny_model: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path / "cache"))
    gguf = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    with pytest.raises(ValueError, match="a GGUF file is served in its own formats"):
        LLM(gguf, quantization="int8")
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model"):
        LLM(tiny_model("llama"), quantization="gguf")
    with pytest.raises(ValueError, match="load_format 'dummy' has no checkpoint weights"):
        LLM(tiny_model("llama"), quantization="int8", load_format="dummy")
    with pytest.raises(ValueError, match="needs a native model implementation"):
        LLM(tiny_model("gpt_neox"), quantization="int8")
    assert LLM(gguf, dtype="float32", quantization="gguf").engine.model is not None
