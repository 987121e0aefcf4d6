"""PEFT as the oracle of per-request scales and adapter mixes: the base model under PEFT with a
requested adapter (scaled by PEFT's `set_scale`) or a mix (PEFT's `add_weighted_adapter` with
combination_type="cat", exactly the rank concatenation), and the engine's logprobs held against it."""

from __future__ import annotations

from typing import Any

import torch

# (adapter name, or a tuple of (name, weight) for a mix, or None for the base model; scale)
Case = tuple[str | tuple[tuple[str, float], ...] | None, float]


def peft_logprobs(base_path: str, adapters: dict[str, str], case: Case, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] next-token logprobs under PEFT in float32 for `case`."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    target, scale = case
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if target is None:
        with torch.no_grad():
            return torch.log_softmax(base(torch.tensor([ids])).logits[0].float(), -1)
    names = [target] if isinstance(target, str) else [n for n, _ in target]
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    active = target if isinstance(target, str) else "mix"
    if not isinstance(target, str):
        model.add_weighted_adapter(names, [w for _, w in target], "mix", combination_type="cat")
    model.set_adapter(active)
    for module in model.modules():
        if isinstance(module, LoraLayer) and active in module.scaling:
            if active == "mix":
                # "cat" puts each w_i * s_i on A: the mix itself scales by 1. (PEFT gives the mix the
                # config of adapters[0] with alpha = r, so an rsLoRA first adapter would scale it by sqrt(r).)
                module.scaling[active] = scale
            else:
                module.set_scale(active, scale)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def logprob_error(out: Any, prompt: list[int], reference: torch.Tensor) -> tuple[float, float]:
    """(largest |ours - PEFT's| over the prompt and generated tokens' logprobs, largest gap between
    PEFT's best next token and each generated one); `out` a RequestOutput with prompt_logprobs=0 and
    logprobs=0, `reference` from `peft_logprobs` over prompt + the generated tokens."""
    completion = out.outputs[0]
    ids = prompt + list(completion.token_ids)
    ours = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(prompt))]
    ours += [pos[tok].logprob for pos, tok in zip(completion.logprobs, completion.token_ids, strict=True)]
    reference = reference[:-1]
    theirs = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    gaps = reference[len(prompt) - 1 :].max(-1).values - theirs[len(prompt) - 1 :]
    return (torch.tensor(ours) - theirs).abs().max().item(), gaps.max().item()
