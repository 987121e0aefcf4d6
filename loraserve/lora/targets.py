"""Which modules of a model take LoRA: every `Linear` but the vocab projection, the checkpoint names
(q_proj, k_proj, ...) of the slices of its packed modules (qkv_proj, gate_up_proj), and the experts
of its MoE layers (`FusedMoE`, which PEFT adapts through `target_parameters`), and, on models that
offer them (`vocab_lora_modules()`), the vocab modules: the input embedding and the LM head. Built once
per model (by the manager) and handed to every adapter read.

Vision-language models name their vision tower and connector (`tower_module_prefixes`): their linears
take LoRA only with --enable-tower-connector-lora; without it an adapter's modules there are skipped
(vLLM's `_filter_unsupported_mm_module`). Such models also say how an adapter's module names map onto
theirs (`canonical_module_name`: PEFT saves the names of the model it trained, which transformers
versions spell differently, e.g. `language_model.model.layers.0...` and `model.language_model.layers.0...`)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import cast

from torch import nn

from loraserve.layers.fused_moe import EXPERT_LEAVES, FusedMoE
from loraserve.layers.linear import Linear

# Linear modules that never take LoRA: the vocab projection (served from the base model only).
UNSUPPORTED_LEAF_NAMES = frozenset({"lm_head"})
# Room a weights file may take beyond its LoRA tensors: the header, a pickle's framing, a few stray
# tensors (an embedding LoRA, which validation then refuses by name, not by size).
FILE_SLACK_BYTES = 64 << 20


@dataclass(frozen=True)
class LoRATargets:
    """The LoRA-capable modules of a model.

    modules:     full module name -> Linear (a LinearWithLoRA once wrapped).
    sub_modules: checkpoint sub-module name -> (packed module name, slice index), e.g.
                 "model.layers.0.self_attn.k_proj" -> ("model.layers.0.self_attn.qkv_proj", 1).
    applied:     the modules that take LoRA when --lora-target-modules leaves some out (`restricted_to`);
                 None: all of them. An adapter's weights for the others are skipped, not refused.
    experts:     full module name -> the experts of an MoE layer ("model.layers.0.mlp.experts").
    vocab:       full module name -> the input embedding (nn.Embedding, "model.embed_tokens") and the
                 LM head (Linear, "lm_head"), where the model serves adapters on them.
    tied_vocab:  whether the LM head shares the embedding's weight (tie_word_embeddings).
    tower_prefixes: a vision-language model's vision tower and connector module prefixes.
    tower_lora:  whether those take LoRA (--enable-tower-connector-lora).
    canonical:   adapter module name -> the model's (None: the same).
    """

    modules: dict[str, Linear]
    sub_modules: dict[str, tuple[str, int]]
    applied: frozenset[str] | None = None
    architecture: str = ""  # the model's class (the HF one for the transformers backend), for errors
    experts: dict[str, FusedMoE] = field(default_factory=dict)
    vocab: dict[str, nn.Module] = field(default_factory=dict)
    tied_vocab: bool = False
    tower_prefixes: tuple[str, ...] = ()
    tower_lora: bool = False
    canonical: Callable[[str], str] | None = None

    @classmethod
    def from_model(cls, model: nn.Module, tower_lora: bool = False) -> LoRATargets:
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        modules = lora_target_modules(model, tower_lora)
        sub_modules: dict[str, tuple[str, int]] = {}
        for name, module in modules.items():
            prefix, _, leaf = name.rpartition(".")
            subs = packed.get(leaf)
            if subs and len(subs) == len(module.output_sizes):
                for i, sub in enumerate(subs):
                    sub_modules[f"{prefix}.{sub}" if prefix else sub] = (name, i)
        architecture = str(getattr(model, "architecture_name", type(model).__name__))
        experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
        vocab_modules = getattr(model, "vocab_lora_modules", None)
        vocab: dict[str, nn.Module] = vocab_modules() if callable(vocab_modules) else {}
        canonical = getattr(model, "canonical_module_name", None)
        return cls(
            modules=modules,
            sub_modules=sub_modules,
            architecture=architecture,
            experts=experts,
            vocab=vocab,
            tied_vocab=bool(getattr(model, "tie_word_embeddings", False)),
            tower_prefixes=tuple(getattr(model, "tower_module_prefixes", ())),
            tower_lora=tower_lora,
            canonical=canonical if callable(canonical) else None,
        )

    def model_name(self, module_name: str) -> str:
        """An adapter's module name as this model names it."""
        return module_name if self.canonical is None else self.canonical(module_name)

    def in_tower(self, module_name: str) -> bool:
        """Whether a (model) module name is in the vision tower or connector."""
        return module_name.startswith(self.tower_prefixes) if self.tower_prefixes else False

    def restricted_to(self, module_names: Iterable[str]) -> LoRATargets:
        """These targets with LoRA applied to `module_names` only (the layers actually wrapped)."""
        applied = frozenset(module_names)
        every = self.modules.keys() | self.experts.keys() | self.vocab.keys()
        return dataclasses.replace(self, applied=None if applied >= every else applied)

    def takes_lora(self, module_name: str) -> bool:
        """Whether `module_name` (a full name in `modules`) carries LoRA in this server."""
        return self.applied is None or module_name in self.applied

    def check_target_modules(self, target_modules: Collection[str] | None) -> None:
        """--lora-target-modules may only name modules this model can put LoRA on."""
        if target_modules is None:
            return
        supported = self.supported_leaf_names()
        unknown = sorted(set(target_modules) - set(supported))
        if unknown:
            raise ValueError(
                f"--lora-target-modules names {unknown}, which this model has no LoRA-capable module for; "
                f"choose among {supported}"
            )

    def supported_leaf_names(self) -> list[str]:
        """Module names an adapter may target (e.g. q_proj, v_proj, qkv_proj, down_proj)."""
        names = {n.rpartition(".")[2] for n in self.modules} | {
            n.rpartition(".")[2] for n in self.sub_modules
        }
        names |= {n.rpartition(".")[2] for n in self.vocab}
        return sorted(names | ({"experts"} if self.experts else set()))

    def expert_module(self, module_name: str) -> str | None:
        """The experts module an adapter module name stands for, or None: PEFT's wrapper of the stacked
        tensors (it nests one per targeted tensor, the inner ones named `<experts>.base_layer...`), or
        one expert's module (`<experts>.<e>.w1`, Mixtral's under `block_sparse_moe`: `expert_part`)."""
        while module_name.endswith(".base_layer"):
            module_name = module_name[: -len(".base_layer")]
        if module_name in self.experts:
            return module_name
        part = self.expert_part(module_name)
        return part[0] if part is not None else None

    def expert_part(self, module_name: str) -> tuple[str, int, str] | None:
        """(experts module, expert, leaf) of a per-expert module name such as
        `model.layers.0.block_sparse_moe.experts.3.w1` (older transformers' nn.Linear experts), or None."""
        prefix, _, leaf = module_name.rpartition(".")
        experts_name, _, index = prefix.rpartition(".")
        experts_name = experts_name.replace(".block_sparse_moe.", ".mlp.")
        experts = self.experts.get(experts_name)
        if experts is None or leaf not in EXPERT_LEAVES or not index.isdigit():
            return None
        return (experts_name, int(index), leaf) if int(index) < experts.num_experts else None

    def max_adapter_bytes(self, max_rank: int) -> int:
        """The most bytes a weights file of a valid adapter of rank <= `max_rank` can hold: every
        module and every slice of a packed one targeted, with a bias, stored as float64 (twice what
        float32 checkpoints take), plus FILE_SLACK_BYTES. A larger file is refused unread."""
        num_slices = Counter(packed for packed, _ in self.sub_modules.values())
        elements = 0
        for name, module in self.modules.items():
            slices = num_slices.get(name, 1)
            elements += max_rank * (slices * module.in_features + module.out_features) + module.out_features
        for experts in self.experts.values():  # per expert: gate, up (H -> I) and down (I -> H) modules
            hidden, size = experts.hidden_size, experts.intermediate_size
            elements += experts.num_experts * max_rank * 3 * (hidden + size)
        for vocab_module in self.vocab.values():  # LoRA, trainable tokens, a saved copy, PEFT's base copy
            vocab_size, hidden = (
                (vocab_module.num_embeddings, vocab_module.embedding_dim)
                if isinstance(vocab_module, nn.Embedding)
                else (int(cast(Linear, vocab_module).out_features), int(cast(Linear, vocab_module).in_features))
            )
            elements += max_rank * (vocab_size + hidden) + 3 * vocab_size * hidden
        return 8 * elements + FILE_SLACK_BYTES

    def locate(self, module_name: str) -> tuple[Linear, str | None, int]:
        """(model layer, packed module name or None, output slice index) of an adapter module name."""
        if module_name in self.modules:
            return self.modules[module_name], None, 0
        packed_name, index = self.sub_modules[module_name]
        return self.modules[packed_name], packed_name, index


def lora_target_modules(model: nn.Module, tower_lora: bool = False) -> dict[str, Linear]:
    """Every `Linear` of the model that can take LoRA, by full module name; a vision-language model's
    tower and connector linears only with `tower_lora`."""
    tower = () if tower_lora else tuple(getattr(model, "tower_module_prefixes", ()))
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear)
        and name.rpartition(".")[2] not in UNSUPPORTED_LEAF_NAMES
        and not (tower and name.startswith(tower))
    }
