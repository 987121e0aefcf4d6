"""An adapter's tensors on the vocab modules (the input embedding, the LM head), split from the rest
and checked into `VocabLoRAWeights`, as PEFT (0.21) saves them:

- LoRA on the embedding: `<emb>.lora_embedding_A` [r, vocab], `<emb>.lora_embedding_B` [hidden, r];
  on the head: `lm_head.lora_A.weight` [r, hidden], `lm_head.lora_B.weight` [vocab, r];
- PEFT's copy of the base module beside them (`<module>.base_layer.weight`, save_embedding_layers):
  accepted when it is this model's weight, refused otherwise (a resized or retrained vocabulary);
- trainable tokens: `<module>.token_adapter.trainable_tokens_delta` [K, hidden], the new rows of the
  config's `trainable_token_indices` (on a tied model the list form also replaces the head's rows);
- modules_to_save: `<module>.weight` [vocab, hidden], served while vocab * hidden is at most
  MAX_SAVED_VOCAB_ELEMENTS (each adapter keeps its own copy in host memory).

Every refusal is a `LoRAAdapterError` naming the adapter and the module.
"""

from __future__ import annotations

import types
from typing import cast

import torch
from torch import nn

from loraserve.errors import LoRAAdapterError
from loraserve.layers.linear import Linear
from loraserve.lora.adapter_checks import ModuleTensors, ValueCheck, layer_weights
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.targets import LoRATargets
from loraserve.lora.weights import LoRALayerWeights, VocabLoRAWeights

MAX_SAVED_VOCAB_ELEMENTS = 64 << 20  # modules_to_save: vocab * hidden (a 32k x 2048 head is exactly this)
_PREFIX = "base_model.model."


def _kind(suffix: str) -> str | None:
    """Which of PEFT's tensors a key on a vocab module is (adapter names, as in `lora_A.default`, dropped)."""
    parts = suffix.split(".")
    if parts[0] in ("lora_embedding_A", "lora_embedding_B") and len(parts) <= 2:
        return "emb_" + parts[0][-1].lower()
    if parts[0] in ("lora_A", "lora_B") and parts[-1] == "weight" and len(parts) in (2, 3):
        return parts[0][-1].lower()
    if parts[:2] == ["token_adapter", "trainable_tokens_delta"] and len(parts) <= 3:
        return "tokens"
    return {"base_layer.weight": "base", "weight": "full"}.get(suffix)


def split_vocab_tensors(
    tensors: dict[str, torch.Tensor], targets: LoRATargets, name: str
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(the other tensors, {vocab module: {kind: tensor}}); a key on a vocab module that is none of
    PEFT's kinds is refused."""
    rest: dict[str, torch.Tensor] = {}
    vocab: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stripped = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        module = next((m for m in targets.vocab if stripped.startswith(m + ".")), None)
        if module is None:
            rest[key] = tensor
            continue
        kind = _kind(stripped[len(module) + 1 :])
        if kind is None:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}': {key} is no LoRA, trainable-token or saved weight"
            )
        vocab.setdefault(module, {})[kind] = tensor
    return rest, vocab


def vocab_weights(
    groups: dict[str, dict[str, torch.Tensor]],
    targets: LoRATargets,
    helper: PEFTHelper,
    name: str,
    values: ValueCheck,
) -> dict[str, VocabLoRAWeights]:
    """Checked `VocabLoRAWeights` by module: the tensors of `split_vocab_tensors`, plus a tied head's
    share of the embedding's trainable tokens."""
    _check_token_ids_in_vocab(targets, helper, name)
    out: dict[str, VocabLoRAWeights] = {}
    for module_name, parts in groups.items():
        base = targets.vocab[module_name]
        weights = VocabLoRAWeights(module_name)
        if "base" in parts:
            _check_base_copy(parts["base"], base, module_name, name)
        weights.lora = _lora(parts, base, module_name, helper, name, values)
        if "tokens" in parts:
            weights.token_ids, weights.token_rows = _tokens(
                parts["tokens"], base, module_name, helper, name, values
            )
        if "full" in parts:
            weights.full = _full(parts["full"], base, module_name, helper, name, values)
        if weights.lora is not None or weights.replaces_rows:
            out[module_name] = weights
    _tie_tokens(out, targets, helper)
    return out


def _check_token_ids_in_vocab(targets: LoRATargets, helper: PEFTHelper, name: str) -> None:
    """Every trainable token id the config names is below its module's vocabulary (whether or not
    the file holds that module's rows): a 400 naming the adapter, the module and the id."""
    for module_name, module in targets.vocab.items():
        ids = helper.trainable_tokens.get(module_name.rpartition(".")[2], ())
        vocab_size = vocab_dims(module)[0]
        for position, token_id in enumerate(ids):
            if token_id >= vocab_size:
                raise LoRAAdapterError(
                    f"LoRA adapter '{name}': trainable_token_indices of {module_name}: index {token_id} (at "
                    f"position {position}) is not below the vocabulary size {vocab_size}"
                )


def _lora(
    parts: dict[str, torch.Tensor],
    base: nn.Module,
    module_name: str,
    helper: PEFTHelper,
    name: str,
    values: ValueCheck,
) -> LoRALayerWeights | None:
    is_embedding = isinstance(base, nn.Embedding)
    a, b = (parts.get("emb_a"), parts.get("emb_b")) if is_embedding else (parts.get("a"), parts.get("b"))
    other = ("a", "b") if is_embedding else ("emb_a", "emb_b")
    if any(k in parts for k in other):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} has LoRA weights of another module kind"
        )
    if a is None and b is None:
        return None
    vocab_size, hidden = vocab_dims(base)
    # The embedding as the Linear PEFT's term amounts to: in = vocab (a one-hot row), out = hidden.
    shape = types.SimpleNamespace(in_features=vocab_size if is_embedding else hidden, bias=None)
    tensors = ModuleTensors(lora_a=a, lora_b=b)
    end = hidden if is_embedding else vocab_size
    return layer_weights(module_name, tensors, helper, cast(Linear, shape), 0, end, name, values)


def vocab_dims(module: nn.Module) -> tuple[int, int]:
    """(vocab, hidden) of an embedding or an LM head (whose weight may live packed elsewhere)."""
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    head = cast(Linear, module)
    return head.out_features, head.in_features


def _check_base_copy(copy: torch.Tensor, base: nn.Module, module_name: str, name: str) -> None:
    weight = cast(torch.Tensor, base.weight).detach()
    if weight.numel() == 0:  # packed for the C kernel, no plain copy to compare: PEFT's copy is unused
        return
    same = (
        tuple(copy.shape) == tuple(weight.shape)
        and copy.is_floating_point()
        and torch.allclose(
            copy.float(), weight.float(), rtol=1e-2, atol=1e-2 * float(weight.abs().max().clamp(min=1e-6))
        )
    )
    if not same:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': it saves a {module_name} weight of shape {tuple(copy.shape)} that is not "
            "this model's (a resized or retrained vocabulary); save the new weight as modules_to_save instead"
        )


def _tokens(
    delta: torch.Tensor, base: nn.Module, module_name: str, helper: PEFTHelper, name: str, values: ValueCheck
) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_size, hidden = vocab_dims(base)
    ids = helper.trainable_tokens.get(module_name.rpartition(".")[2])
    if ids is None:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} has trainable tokens its trainable_token_indices do not name"
        )
    # (distinct, >= 0: checked with the config; below the vocabulary: `_check_token_ids_in_vocab`)
    if tuple(delta.shape) != (len(ids), hidden):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} trainable tokens have shape {tuple(delta.shape)}, expected "
            f"({len(ids)}, {hidden})"
        )
    _check_values(delta, module_name, "trainable tokens", name, values)
    return torch.tensor(ids, dtype=torch.long), delta


def _full(
    weight: torch.Tensor, base: nn.Module, module_name: str, helper: PEFTHelper, name: str, values: ValueCheck
) -> torch.Tensor:
    leaf = module_name.rpartition(".")[2]
    if not any(m.rpartition(".")[2] == leaf for m in helper.modules_to_save):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': it saves {module_name}, which modules_to_save does not name"
        )
    if tuple(weight.shape) != vocab_dims(base):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': its saved {module_name} has shape {tuple(weight.shape)}, this model's is "
            f"{vocab_dims(base)}"
        )
    if weight.numel() > MAX_SAVED_VOCAB_ELEMENTS:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': modules_to_save {module_name} of {weight.numel()} elements "
            f"({tuple(weight.shape)}) is larger than the {MAX_SAVED_VOCAB_ELEMENTS} served per adapter"
        )
    _check_values(weight, module_name, "modules_to_save weight", name, values)
    return weight


def _check_values(tensor: torch.Tensor, module_name: str, label: str, name: str, values: ValueCheck) -> None:
    if not tensor.is_floating_point() or not values.ok(tensor, 1.0):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} {label} have non-finite or non-float values, or values "
            "that overflow the LoRA dtype"
        )


def _tie_tokens(out: dict[str, VocabLoRAWeights], targets: LoRATargets, helper: PEFTHelper) -> None:
    """PEFT ties a list of trainable tokens on a tied model's embedding to the head: the head's logits
    of those tokens use the new rows too (unless the config names the head's own)."""
    heads = [m for m, mod in targets.vocab.items() if isinstance(mod, Linear)]
    embedding = next((w for m, w in out.items() if isinstance(targets.vocab[m], nn.Embedding)), None)
    if not (targets.tied_vocab and heads and embedding is not None and embedding.token_ids is not None):
        return
    if "lm_head" in helper.trainable_tokens:
        return
    head = out.setdefault(heads[0], VocabLoRAWeights(heads[0]))
    head.token_ids, head.token_rows = embedding.token_ids, embedding.token_rows
