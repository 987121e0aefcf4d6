"""PEFT adapters on the vocab modules for tests: random LoRA weights (PEFT's init would leave B zero),
trainable-token rows and saved modules moved off the base (PEFT's init copies the base)."""

from __future__ import annotations

from typing import Any

import torch


def save_vocab_adapter(base: Any, out_dir: str, seed: int, base_name: str, **kwargs: Any) -> None:
    """A PEFT adapter with random LoRA weights, trainable-token rows and saved modules (PEFT's init
    would leave B zero, the tokens and saved modules equal to the base)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**kwargs), adapter_name="default")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
            elif "trainable_tokens_delta" in name:
                param.add_(torch.randn_like(param) * 0.5)
            elif "modules_to_save" in name:
                # A fine-tuned copy stays near the base: logits of the base's size, rounded alike in bf16.
                param.add_(torch.randn_like(param) * 0.05)
    model.peft_config["default"].base_model_name_or_path = base_name
    model.save_pretrained(out_dir)
    model.unload()
