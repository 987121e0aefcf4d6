"""transformers / PEFT as the oracle of vision-language serving: the same prompt text and images
through the model's own processor, then `generate` (greedy tokens and their logprobs) or one full
forward over the prompt and given tokens (teacher forcing, for bf16 checks)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from loraserve.demo.random_model import save_peft_adapter
from loraserve.lora.request import LoRARequest
from loraserve.multimodal.processor import load_hf_processor

HF_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
# Adapter targets: the language model's modules only, and some of the tower's and connector's too.
LM_TARGETS = r".*(language_model|text_model).*\.(q_proj|v_proj|o_proj|down_proj)"
TOWER_TARGETS = {
    "llava": ["q_proj", "v_proj", "fc1", "linear_1", "gate_proj"],
    "llava_next": ["q_proj", "fc2", "linear_2"],
    "gemma3": ["q_proj", "fc1", "up_proj"],
    "idefics3": ["q_proj", "fc1", "proj", "up_proj"],
    "smolvlm": ["k_proj", "fc2", "proj", "gate_proj"],
    "qwen2_vl": ["qkv", "fc1", "mlp.0", "q_proj", "down_proj"],
    "qwen2_5_vl": ["qkv", "up_proj", "mlp.2", "o_proj"],
}


def save_vlm_adapters(hf_model: Any, arch: str, folder: str, base: str) -> dict[str, str]:
    """A language-model adapter ("lm") and one with tower/connector modules too ("tower")."""
    paths = {"lm": os.path.join(folder, "lm"), "tower": os.path.join(folder, "tower")}
    save_peft_adapter(hf_model, paths["lm"], 3, base, r=8, lora_alpha=16, target_modules=LM_TARGETS)
    save_peft_adapter(
        hf_model, paths["tower"], 4, base, r=8, lora_alpha=16, target_modules=TOWER_TARGETS[arch]
    )
    return paths


def peft_vlm(arch: str, path: str, adapters: dict[str, str], dtype: torch.dtype = torch.float32) -> Any:
    import transformers
    from peft import PeftModel

    base = getattr(transformers, HF_CLASSES[arch]).from_pretrained(path, dtype=dtype).eval()
    (first, folder), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, folder, adapter_name=first)
    for name, other in rest:
        model.load_adapter(other, adapter_name=name)
    return model.eval()


def hf_inputs(processor: Any, arch: str, text: str, images: list[Any] | None) -> dict[str, torch.Tensor]:
    """The model's inputs for `text` (and its images) as the processor makes them."""
    if not images:
        return dict(processor.tokenizer([text], return_tensors="pt"))
    inputs = dict(processor(text=[text], images=[images], return_tensors="pt"))
    if arch != "gemma3":  # Gemma-3 reads token_type_ids (its bidirectional image mask); others refuse it
        inputs.pop("token_type_ids", None)
    return inputs


@contextlib.contextmanager
def active(model: Any, adapter: str | None) -> Iterator[None]:
    if adapter is None:
        with model.disable_adapter():
            yield
    else:
        model.set_adapter(adapter)
        yield


def generate(
    model: Any, adapter: str | None, inputs: dict[str, torch.Tensor], num_new: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate` (no end-of-sequence stop): tokens and their logprobs."""
    with torch.no_grad(), active(model, adapter):
        out = model.generate(
            **inputs,
            max_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def scored_logprobs(
    model: Any, adapter: str | None, inputs: dict[str, torch.Tensor], tokens: list[int]
) -> torch.Tensor:
    """The model's logprob rows [prompt length - 1 + len(tokens), vocab]: each prompt position's (one
    forward over the prompt), then each of `tokens`' as `generate` scores it when made to follow them
    (a generated token may be a placeholder id, which one forward over prompt and tokens would take for
    an image's)."""
    length = inputs["input_ids"].shape[1]
    with torch.no_grad(), active(model, adapter):
        prompt_rows = torch.log_softmax(model(**inputs).logits[0, :-1].float(), -1)
        if not tokens:
            return prompt_rows
        out = model.generate(
            **inputs,
            max_new_tokens=len(tokens),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            prefix_allowed_tokens_fn=lambda _, ids: [tokens[len(ids) - length]],
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    return torch.cat([prompt_rows, generated])


def processor_of(path: str) -> Any:
    return load_hf_processor(path)


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(adapters.items())}
