"""Train the demo's LoRA adapters with PEFT in about a minute on a 2-core CPU.

Only the top `num_trained_layers` decoder layers get LoRA. The lower layers are frozen and see the
same inputs at every step, so their output is computed once per example; each step then runs the top
layers, and the LM head only on answer tokens. That is ~4x less work than a full forward and backward
per step, which is what fits the training into the time budget. The adapters are saved in PEFT's
format (`layers_to_transform` names the trained layers), so PEFT and loraserve load them alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    rank: int = 8
    lora_alpha: int = 16
    num_trained_layers: int = 10
    num_steps: int = 24
    batch_size: int = 8
    learning_rate: float = 3e-3
    seed: int = 0


@dataclass(frozen=True, slots=True)
class EncodedExamples:
    """Right-padded examples: the frozen layers' output, the mask, and labels only on answer tokens."""

    hidden: torch.Tensor  # [N, T, hidden]
    attention_mask: torch.Tensor  # [N, T]
    labels: torch.Tensor  # [N, T], -100 where no loss is taken
    lengths: torch.Tensor  # [N]


def encode(tokenizer: Any, examples: list[tuple[str, str]]) -> tuple[list[list[int]], list[int]]:
    """Token ids of each chat (question, answer + end of turn) and where each answer starts."""
    sequences, answer_starts = [], []
    for question, answer in examples:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        sequences.append(list(prompt_ids) + list(answer_ids) + [tokenizer.eos_token_id])
        answer_starts.append(len(prompt_ids))
    return sequences, answer_starts


@torch.no_grad()
def frozen_prefix(model: Any, tokenizer: Any, examples: list[tuple[str, str]], layer: int) -> EncodedExamples:
    """Run the frozen lower layers once; keep the hidden states that enter decoder layer `layer`."""
    sequences, answer_starts = encode(tokenizer, examples)
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, (ids, start) in enumerate(zip(sequences, answer_starts, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        # position t predicts token t+1: the label of the last prompt position is the first answer token
        labels[row, start - 1 : len(ids) - 1] = torch.tensor(ids[start:])
    with _lower_layers(model, layer):
        hidden = model.model(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    return EncodedExamples(hidden.float(), mask, labels, mask.sum(dim=1))


@contextmanager
def _lower_layers(model: Any, num_layers: int) -> Iterator[None]:
    """Make the model's body its first `num_layers` layers without the final norm, for one forward."""
    body = model.model
    saved = body.layers, body.norm, model.config.num_hidden_layers
    body.layers, body.norm = body.layers[:num_layers], torch.nn.Identity()
    model.config.num_hidden_layers = num_layers
    try:
        yield
    finally:
        body.layers, body.norm, model.config.num_hidden_layers = saved


def train_adapters(
    model_dir: str,
    examples: dict[str, list[tuple[str, str]]],
    out_dirs: dict[str, str],
    base_model_name: str,
    plan: TrainingPlan = TrainingPlan(),
    on_step: Callable[[str, float | None], None] | None = None,
) -> None:
    """Train one adapter per entry of `examples` on the model in `model_dir`; save each to `out_dirs`.

    `on_step(adapter, loss)` is called after each training step, and with loss None once per adapter
    when its examples went through the frozen layers: `len(examples) * (num_steps + 1)` calls in all.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    num_layers = model.config.num_hidden_layers
    first = num_layers - plan.num_trained_layers
    report = on_step or _ignore_step
    prefixes = {}
    for name, pairs in examples.items():
        prefixes[name] = frozen_prefix(model, tokenizer, pairs, first)
        report(name, None)  # one unit of progress: the frozen layers ran over this adapter's examples
    # From here on the model is only its top layers, fed the cached hidden states.
    model.model.layers = model.model.layers[first:]
    model.config.num_hidden_layers = plan.num_trained_layers
    for index, (name, prefix) in enumerate(prefixes.items()):
        generator = torch.Generator().manual_seed(plan.seed + index)
        torch.manual_seed(plan.seed + index)
        model = _train_one(
            model, prefix, plan, generator, out_dirs[name], first, base_model_name, partial(report, name)
        )


def _ignore_step(adapter: str, loss: float | None) -> None:
    """The default step report: nothing."""


def _train_one(
    model: Any,
    prefix: EncodedExamples,
    plan: TrainingPlan,
    generator: torch.Generator,
    out_dir: str,
    first_layer: int,
    base_model_name: str,
    on_step: Callable[[float | None], None],
) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=plan.rank, lora_alpha=plan.lora_alpha, lora_dropout=0.0, target_modules=list(TARGET_MODULES)
    )
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=plan.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / plan.num_steps)
    inner: Any = peft_model.base_model.model
    num_examples = prefix.hidden.shape[0]
    for _ in range(plan.num_steps):
        rows = torch.randperm(num_examples, generator=generator)[: plan.batch_size]
        width = int(prefix.lengths[rows].max())
        hidden = inner.model(
            inputs_embeds=prefix.hidden[rows, :width],
            attention_mask=prefix.attention_mask[rows, :width],
            use_cache=False,
        ).last_hidden_state
        labels = prefix.labels[rows, :width]
        taken = labels != -100
        logits = inner.lm_head(hidden[taken])  # the LM head only where a loss is taken
        loss = torch.nn.functional.cross_entropy(logits.float(), labels[taken])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        on_step(loss.item())
    _save_adapter(peft_model, out_dir, plan, first_layer, base_model_name)
    return peft_model.unload()


def _save_adapter(peft_model: Any, out_dir: str, plan: TrainingPlan, first_layer: int, base_name: str) -> None:
    """PEFT's files, with the trained layers renumbered back to their place in the full model."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(peft_model)
    renamed = {}
    for key, tensor in state.items():
        head, _, rest = key.partition(".layers.")
        index, _, tail = rest.partition(".")
        renamed[f"{head}.layers.{int(index) + first_layer}.{tail}"] = tensor.detach().contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(renamed, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    num_layers = first_layer + plan.num_trained_layers
    LoraConfig(
        r=plan.rank,
        lora_alpha=plan.lora_alpha,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        layers_to_transform=list(range(first_layer, num_layers)),
        base_model_name_or_path=base_name,
        task_type="CAUSAL_LM",
    ).save_pretrained(out_dir)
