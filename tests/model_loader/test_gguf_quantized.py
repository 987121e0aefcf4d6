"""GGUF files served with their quantized linears kept quantized (the default for quantized Llama/Qwen
files) against the same file dequantized (LORASERVE_GGUF_DEQUANTIZE=1, the old path: the oracle here),
and adapters on the quantized base against PEFT on transformers' dequantized model.

The tiny file mixes every kept format (Q8_0, Q4_0, Q4_1 written by gguf.quants; Q4_K, Q5_K, Q6_K as
random blocks) in its packed layers (qkv, gate_up) and its LM head, with rows of 256 and 512 weights.
float32 serving at two activation levels (within amax/32512 of each value) must match to 1e-4 in
logprobs; at one (the default) and in bf16 the activations are int8 (as llama.cpp's), compared by
logprobs teacher-forced on our tokens."""

from __future__ import annotations

import mmap
import os
from typing import Any

import pytest
import torch
from support.gguf_files import write_tiny_llama_gguf
from support.oracles import assert_matches_peft

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.layers.linear import Linear
from loraserve.layers.quant.embedding import QuantEmbedding
from loraserve.model_loader.gguf import gguf_folder
from loraserve.model_loader.gguf_quantized import QUANT_INDEX
from loraserve.native import huge_pages

PROMPTS = ["the cat in the hat", "on a mat", "hello there friend"]
TYPES = {
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q5_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "Q4_0",
    "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q8_0",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "Q4_0",
    "blk.1.attn_output.weight": "Q4_1",
    "blk.1.ffn_gate.weight": "Q5_K",
    "blk.1.ffn_up.weight": "Q4_K",
    "blk.1.ffn_down.weight": "Q4_K",
    "output.weight": "Q6_K",
    "token_embd.weight": "Q8_0",
}


@pytest.fixture()
def cache_root(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    root = str(tmp_path / "cache")
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", root)
    monkeypatch.delenv("LORASERVE_GGUF_DEQUANTIZE", raising=False)
    return root


@pytest.fixture()
def tiny(tmp_path: Any) -> str:
    return write_tiny_llama_gguf(
        str(tmp_path / "tiny.gguf"), raw_types=TYPES, hidden=256, ffn=512, weight_std=0.02
    )


_GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def _dequantized_llm(monkeypatch: pytest.MonkeyPatch, path: str, **kwargs: Any) -> LLM:
    with monkeypatch.context() as patch:
        patch.setenv("LORASERVE_GGUF_DEQUANTIZE", "1")
        return LLM(path, **kwargs)


def _quantized_linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.quant_parts is not None]


@pytest.mark.parametrize("levels, tolerance", [(1, 0.2), (2, 5e-4)], ids=["one level", "two levels"])
def test_quantized_float32_equals_dequantized(
    tiny: str, cache_root: str, monkeypatch: pytest.MonkeyPatch, levels: int, tolerance: float
) -> None:
    """Logprobs within what the activations' int8 levels leave, teacher-forced on our greedy tokens,
    each of which the dequantized model ranks within the same distance of its best. One level
    (llama.cpp's precision, the default) quantizes every step's activations, the prompts' too: measured
    up to 0.14 on this random model (near-ties: the greedy path may turn). Two keep float32's (2e-4),
    where the prompts run torch's tile path: the greedy tokens are the dequantized model's. A wrong scale,
    min or nibble moves logprobs by whole units."""
    monkeypatch.setenv("LORASERVE_CPU_QUANT_ACT_LEVELS", str(levels))
    llm = LLM(tiny, dtype="float32")
    assert all(
        part.act_levels == levels for m in _quantized_linears(llm) for part in m.quant_parts or [] if part
    )
    quantized = _quantized_linears(llm)
    assert len(quantized) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all(m.weight.numel() == 0 for m in quantized)  # no dense copy is kept
    # the file's formats; held in panels of 8 rows at one level (formats.repack_panels), the per-32 ones
    # in their row layout at two (formats.repack_rows), the K-quants in the file's (so are rows not a
    # multiple of 8)
    parts = [part.tensor for m in quantized for part in m.quant_parts or [] if part]
    assert {t.qtype.source for t in parts} == {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}
    layout = "P" if levels == 1 else "R"
    assert {t.qtype.name for t in parts if t.qtype.block_size == 32} == {f"Q8_0{layout}", f"Q4_0{layout}", f"Q4_1{layout}"}
    k_parts = [t for t in parts if t.qtype.block_size == 256]  # panels need a multiple of 8 rows
    assert all(t.qtype.name == t.qtype.source + ("P" if levels == 1 and t.shape[0] % 8 == 0 else "") for t in k_parts)
    assert levels == 2 or {t.qtype.name for t in k_parts} >= {"Q4_KP", "Q5_KP", "Q6_KP"}
    embedding = llm.engine.model.model.embed_tokens  # gathered from its Q8_0 blocks, no dense table
    assert isinstance(embedding, QuantEmbedding) and embedding.qtype.source == "Q8_0"
    model = llm.engine.model
    if model.tie_word_embeddings:  # the head's layout (rows here: 267 rows make no panels), held once
        head = model.lm_head.quant_parts[0]
        assert head is not None and embedding.blocks.data_ptr() == head.tensor.blocks.data_ptr()
    if hasattr(mmap, "MADV_HUGEPAGE"):  # moved into one mapping on huge pages (layers.linear.home_quantized)
        starts = sorted(t.blocks.data_ptr() for t in parts)
        assert starts[0] % huge_pages.HUGE_PAGE == 0 and starts[-1] - starts[0] < sum(t.nbytes + 64 for t in parts)
    reference = _dequantized_llm(monkeypatch, tiny, dtype="float32")
    assert not _quantized_linears(reference)
    ours = llm.generate(PROMPTS, _GREEDY, use_tqdm=False)
    if levels == 2:
        want = reference.generate(PROMPTS, _GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in ours] == [list(o.outputs[0].token_ids) for o in want]
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for output in ours:
        prompt, out = list(output.prompt_token_ids), output.outputs[0]
        scored = reference.generate([{"prompt_token_ids": prompt + list(out.token_ids)}], scoring, use_tqdm=False)
        entries = scored[0].prompt_logprobs
        assert entries is not None
        for i, (token, ours_entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            entry = entries[len(prompt) + i]
            assert max(v.logprob for v in entry.values()) - entry[token].logprob <= tolerance
            assert abs(entry[token].logprob - ours_entry[token].logprob) <= tolerance


def test_cache_entries_and_the_dequantize_switch(
    tiny: str, cache_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = gguf_folder(tiny, torch.float32)
    assert os.path.isfile(os.path.join(kept, QUANT_INDEX))
    monkeypatch.setenv("LORASERVE_GGUF_DEQUANTIZE", "1")
    dense = gguf_folder(tiny, torch.float32)
    assert dense != kept and not os.path.isfile(os.path.join(dense, QUANT_INDEX))
    # the folder is about the quantized size, not the float32 one
    size = os.path.getsize(os.path.join(kept, "model.safetensors"))
    assert size < 0.6 * os.path.getsize(os.path.join(dense, "model.safetensors"))


def test_a_dense_folder_on_request_is_one_transformers_loads(
    tiny: str, cache_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_quantized=False (the demo trains its adapters on it) gives the dense folder whatever the
    default, and transformers loads it (a quantized folder's uint8 blocks it would refuse)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv("LORASERVE_GGUF_DEQUANTIZE", raising=False)
    dense = gguf_folder(tiny, torch.float32, keep_quantized=False)
    assert dense != gguf_folder(tiny, torch.float32)
    assert not os.path.isfile(os.path.join(dense, QUANT_INDEX))
    AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)


def _peft_errors(peft_model: Any, tokenizer: Any, jobs: list[Any], outputs: list[Any]) -> torch.Tensor:
    """|our logprob - PEFT's| of every generated token (teacher forcing, PEFT in float32)."""
    errors = []
    for (prompt, lora), output in zip(jobs, outputs, strict=True):
        ids, out = list(tokenizer(prompt)["input_ids"]), output.outputs[0]
        with torch.no_grad():
            if lora is None:
                with peft_model.disable_adapter():
                    logits = peft_model(torch.tensor([ids + list(out.token_ids)])).logits[0]
            else:
                peft_model.set_adapter(lora.lora_name)
                logits = peft_model(torch.tensor([ids + list(out.token_ids)])).logits[0]
        reference = torch.log_softmax(logits.float(), -1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            errors.append(abs(reference[len(ids) - 1 + i, token].item() - entry[token].logprob))
    return torch.tensor(errors)


def _adapters(tiny: str, tmp_path: Any) -> tuple[Any, Any, dict[str, str]]:
    """(PEFT on transformers' dequantized model with adapters "attn" and "mlp", tokenizer, their paths)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(tiny), os.path.basename(tiny)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    targets = {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}
    paths = {}
    for seed, (adapter, modules) in enumerate(targets.items()):
        paths[adapter] = str(tmp_path / adapter)
        save_peft_adapter(model, paths[adapter], 7 + seed, tiny, r=4, lora_alpha=8, target_modules=modules)
    peft_model = PeftModel.from_pretrained(model, paths["attn"], adapter_name="attn")
    peft_model.load_adapter(paths["mlp"], adapter_name="mlp")
    return peft_model.eval(), tokenizer, paths


def _mixed_batch(llm: LLM, paths: dict[str, str]) -> tuple[list[Any], list[Any]]:
    loras = [None, LoRARequest("attn", 1, paths["attn"]), LoRARequest("mlp", 2, paths["mlp"])]
    jobs = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.generate(
        [p for p, _ in jobs], params, lora_request=[lora for _, lora in jobs], use_tqdm=False
    )
    return jobs, outputs


def test_adapters_on_the_quantized_base_equal_peft(
    tiny: str, cache_root: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 at two activation levels, mixed batch (base and two adapters at once): each token within
    2e-3 of PEFT's argmax on transformers' dequantized model, its logprob within 2e-3 of PEFT's (teacher
    forcing). (The default, one level, errs as the bf16 test below bounds.)"""
    monkeypatch.setenv("LORASERVE_CPU_QUANT_ACT_LEVELS", "2")
    peft_model, tokenizer, paths = _adapters(tiny, tmp_path)
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4)
    assert _quantized_linears(llm)
    jobs, outputs = _mixed_batch(llm, paths)
    for (prompt, lora), output in zip(jobs, outputs, strict=True):
        out = output.outputs[0]
        logprobs = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs, strict=True)]
        ids = list(tokenizer(prompt)["input_ids"])
        assert list(output.prompt_token_ids) == ids
        assert_matches_peft(
            peft_model, lora.lora_name if lora else None, ids, list(out.token_ids), logprobs, 2e-3
        )


def test_adapters_on_the_quantized_base_in_bf16_err_as_bf16_does(
    tiny: str, cache_root: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, the same mixed batch: against PEFT in float32, the quantized base (int8 activations on
    every step, the prompts' too) errs a little more than the dequantized bf16 model does, whose error
    is bf16's own (this tiny model's near-ties: mean 0.013, worst 0.12 with an adapter; measured on the
    quantized base: mean 0.023, worst 0.21). A LoRA term or a weight gone wrong moves logprobs by
    tenths on average."""
    peft_model, tokenizer, paths = _adapters(tiny, tmp_path)
    llm = LLM(tiny, dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=4)
    assert _quantized_linears(llm)
    ours = _peft_errors(peft_model, tokenizer, *_mixed_batch(llm, paths))
    reference = _dequantized_llm(
        monkeypatch, tiny, dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=4
    )
    dense = _peft_errors(peft_model, tokenizer, *_mixed_batch(reference, paths))
    assert ours.mean().item() <= dense.mean().item() + 0.025
    assert ours.max().item() <= dense.max().item() + 0.2
