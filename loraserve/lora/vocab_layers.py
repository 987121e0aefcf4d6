"""Adapters on the vocab modules, per request in mixed batches: `EmbeddingWithLoRA` (the input
embedding) and `HeadWithLoRA` (the LM head), each holding up to `max_loras` slots of
`VocabLoRAWeights`.

LoRA runs through the shared LoRA ops, so every backend (C kernel, Triton, torch) and per-request
scale serves it. The head is a plain linear term over the full vocab. The embedding's term for
token t, scaling * B @ A[:, t], is the expand of a row gathered from A^T: each slot keeps A^T in a
table [vocab, R], the step gathers row (s_i, t_i) for each token, and the layer's `LoRABuffers` holds
an identity A [r, R] and B, so `ops.add_lora` forms c_i * B (I t) exactly (one nonzero product per
sum). Slot buffers are vocab * R per slot: they are allocated when the first adapter with such a term
reaches a slot, so a server whose adapters leave the vocab modules alone spends nothing on them.

Replacements (trainable tokens, modules_to_save) are per-slot tensors referenced, not copied: a
slot's tokens get their rows (embedding) or logits (head) from the adapter's own weights, after the
base product. Rows of other slots and of slot -1 are left bit-for-bit alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.layers.linear import Linear
from loraserve.lora import ops
from loraserve.lora.ops.block_writer import BlockWriter
from loraserve.lora.ops.buffers import LoRABuffers
from loraserve.lora.weights import LoRALayerWeights, ModuleLoRA, VocabLoRAWeights


class VocabSlots:
    """What each slot holds for one vocab module: its LoRA buffers (lazy), and its replacements."""

    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self.in_features, self.out_features = in_features, out_features
        self.buffers: LoRABuffers | None = None
        self.tokens: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * max_loras
        self.full: list[torch.Tensor | None] = [None] * max_loras
        self.rows_mask = 0  # bit s: slot s replaces rows

    def lora_mask(self) -> int:
        return 0 if self.buffers is None else self.buffers.active_mask

    def write(self, slot: int, lora: LoRALayerWeights | None, writer: BlockWriter | None) -> None:
        if lora is not None and self.buffers is None:
            self.buffers = LoRABuffers.allocate(
                self.max_loras,
                self.max_rank,
                self.in_features,
                [0, self.out_features],
                self.dtype,
                self.device,
                False,
            )
        if self.buffers is not None:
            self.buffers.write(slot, [lora], writer)

    def set_rows(self, slot: int, weights: VocabLoRAWeights | None, vocab_size: int) -> None:
        self.tokens[slot], self.full[slot] = None, None
        if weights is not None and weights.token_ids is not None and weights.token_rows is not None:
            # A dense token -> row map: the gather of a step is one index_select.
            where = torch.full((vocab_size,), -1, dtype=torch.long, device=self.device)
            where[weights.token_ids] = torch.arange(len(weights.token_ids), device=self.device)
            self.tokens[slot] = (weights.token_ids, weights.token_rows, where)
        if weights is not None and weights.full is not None:
            self.full[slot] = weights.full
        bit = 1 << slot
        replaces = self.tokens[slot] is not None or self.full[slot] is not None
        self.rows_mask = self.rows_mask | bit if replaces else self.rows_mask & ~bit


def _vocab_weights(lora: ModuleLoRA, module: str) -> VocabLoRAWeights:
    if not isinstance(lora, VocabLoRAWeights):
        raise ValueError(f"{module}: {type(lora).__name__} weights for a vocab module")
    return lora


def _check_slot(slot: int, max_loras: int) -> None:
    if not 0 <= slot < max_loras:
        raise ValueError(f"slot {slot} is out of range for max_loras={max_loras}")


class EmbeddingWithLoRA(nn.Module):
    """x[i] = E[t_i] (a slot's replacement row where it has one) + c_i * scaling * B[s_i] A[s_i][:, t_i]."""

    takes_batch = True  # the model passes the step's ForwardBatch

    def __init__(
        self, base: nn.Embedding, max_loras: int, max_lora_rank: int, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.weight = base.weight  # same parameter, same state-dict name
        self.num_embeddings, self.embedding_dim, self.padding_idx = (
            base.num_embeddings,
            base.embedding_dim,
            base.padding_idx,
        )
        lora_dtype = dtype or base.weight.dtype
        self.slots = VocabSlots(
            max_loras, max_lora_rank, max_lora_rank, self.embedding_dim, lora_dtype, base.weight.device
        )
        self.a_table: torch.Tensor | None = None  # [L, vocab, R]: each slot's A^T, zero beyond its rank

    def set_lora(self, slot: int, lora: ModuleLoRA, writer: BlockWriter | None = None) -> None:
        _check_slot(slot, self.slots.max_loras)
        weights = _vocab_weights(lora, "embed_tokens")
        part = weights.lora
        if part is not None:
            r, rank = part.rank, self.slots.max_rank
            if (
                tuple(part.lora_a.shape) != (r, self.num_embeddings)
                or tuple(part.lora_b.shape) != (self.embedding_dim, r)
                or not 0 < r <= rank
            ):
                raise ValueError(
                    f"{part.module_name}: embedding LoRA of A {tuple(part.lora_a.shape)}, B "
                    f"{tuple(part.lora_b.shape)} does not fit vocab={self.num_embeddings}, "
                    f"hidden={self.embedding_dim}, max_lora_rank={rank}"
                )
            if self.a_table is None:
                self.a_table = torch.zeros(
                    self.slots.max_loras,
                    self.num_embeddings,
                    rank,
                    dtype=self.slots.dtype,
                    device=self.slots.device,
                )
            self.a_table[slot].zero_()
            self.a_table[slot, :, :r].copy_(part.lora_a.t())
            identity = torch.eye(r, rank, dtype=self.slots.dtype, device=self.slots.device)
            part = LoRALayerWeights(part.module_name, r, identity, part.lora_b, part.scaling)
        elif self.a_table is not None and self.slots.lora_mask() >> slot & 1:
            self.a_table[slot].zero_()
        self.slots.write(slot, part, writer)
        self.slots.set_rows(slot, weights, self.num_embeddings)

    def reset_lora(self, slot: int, writer: BlockWriter | None = None) -> None:
        _check_slot(slot, self.slots.max_loras)
        if self.a_table is not None and self.slots.lora_mask() >> slot & 1:
            self.a_table[slot].zero_()
        self.slots.write(slot, None, writer)
        self.slots.set_rows(slot, None, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight, self.padding_idx)
        mapping = batch.lora if batch is not None else None
        if mapping is None or not (self.slots.lora_mask() | self.slots.rows_mask) & mapping.active_mask:
            return x
        ids, slots = input_ids.reshape(-1), mapping.token_slots
        x2 = x.view(-1, self.embedding_dim)
        _replace_rows(x2, ids, slots, self.slots, mapping, embedding=True)
        buffers = self.slots.buffers
        if buffers is not None and self.a_table is not None and buffers.active_mask & mapping.active_mask:
            flat = slots.clamp(min=0) * self.num_embeddings + ids
            t = self.a_table.view(-1, self.slots.max_rank).index_select(0, flat)
            t.masked_fill_((slots < 0)[:, None], 0.0)  # rows without an adapter read nothing
            ops.add_lora(x2, t, buffers, mapping)
        return x

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, max_loras={self.slots.max_loras}"


class HeadWithLoRA(Linear):
    """logits[i] = h_i W^T (a slot's replacement rows or matrix where it has one) + c_i B[s_i] A[s_i] h_i."""

    takes_lora_rows = True  # compute_logits passes the sampled rows' mapping

    def __init__(self, base: Linear, max_loras: int, max_lora_rank: int, dtype: torch.dtype | None) -> None:
        nn.Module.__init__(self)  # adopt the base layer's parameters (Linear.__init__ would allocate)
        self.in_features, self.output_sizes, self.out_features = (
            base.in_features,
            list(base.output_sizes),
            base.out_features,
        )
        self.weight, self.bias = base.weight, base.bias
        self.packed_weight, self.kernel_weight, self.quant_parts = (
            base.packed_weight,
            base.kernel_weight,
            base.quant_parts,
        )
        lora_dtype = dtype or base.weight.dtype
        self.slots = VocabSlots(
            max_loras, max_lora_rank, self.in_features, self.out_features, lora_dtype, base.weight.device
        )

    @property
    def lora_active(self) -> bool:
        """Whether any slot holds a head term (the runner builds the logits rows' mapping only then)."""
        return bool(self.slots.lora_mask() | self.slots.rows_mask)

    def set_lora(self, slot: int, lora: ModuleLoRA, writer: BlockWriter | None = None) -> None:
        _check_slot(slot, self.slots.max_loras)
        weights = _vocab_weights(lora, "lm_head")
        part = weights.lora
        if part is not None and (
            tuple(part.lora_a.shape) != (part.rank, self.in_features)
            or tuple(part.lora_b.shape) != (self.out_features, part.rank)
            or not 0 < part.rank <= self.slots.max_rank
        ):
            raise ValueError(
                f"{part.module_name}: LoRA of A {tuple(part.lora_a.shape)}, B "
                f"{tuple(part.lora_b.shape)} does not fit the LM head"
            )
        self.slots.write(slot, part, writer)
        self.slots.set_rows(slot, weights, self.out_features)

    def reset_lora(self, slot: int, writer: BlockWriter | None = None) -> None:
        _check_slot(slot, self.slots.max_loras)
        self.slots.write(slot, None, writer)
        self.slots.set_rows(slot, None, self.out_features)

    def logits(self, hidden: torch.Tensor, mapping: LoRABatchMapping | None) -> torch.Tensor:
        """The logits of `hidden` [N, in], row i with its adapter's head terms (mapping: of these rows)."""
        y = self.base_forward(hidden)
        if mapping is None or not (self.slots.lora_mask() | self.slots.rows_mask) & mapping.active_mask:
            return y
        y2, h2 = y.view(-1, self.out_features), hidden.reshape(-1, self.in_features)
        _replace_rows(y2, h2, mapping.token_slots, self.slots, mapping, embedding=False)
        buffers = self.slots.buffers
        if buffers is not None and buffers.active_mask & mapping.active_mask:
            ops.add_lora(y2, h2, buffers, mapping)
        return y

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.logits(x, batch.lora if batch is not None else None)


def _replace_rows(
    out: torch.Tensor,
    source: torch.Tensor,
    slots: torch.Tensor,
    table: VocabSlots,
    mapping: LoRABatchMapping,
    embedding: bool,
) -> None:
    """Each slot's replacements on its own rows of `out`: the embedding's rows by token id (`source`
    the ids), or the head's logits from the hidden rows (`source` [N, in])."""
    mask = table.rows_mask & mapping.active_mask
    for slot in (s for s in range(table.max_loras) if mask >> s & 1):
        rows = (slots == slot).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        full, tokens = table.full[slot], table.tokens[slot]
        if embedding:
            ids = source.index_select(0, rows)
            if full is not None:
                out.index_copy_(0, rows, full.index_select(0, ids).to(out.dtype))
            elif tokens is not None:
                where = tokens[2].index_select(0, ids)
                hit = where >= 0
                out.index_copy_(0, rows[hit], tokens[1].index_select(0, where[hit]).to(out.dtype))
            continue
        h = source.index_select(0, rows)
        if full is not None:
            out.index_copy_(0, rows, (h.to(full.dtype) @ full.t()).to(out.dtype))
        elif tokens is not None:
            token_ids, token_rows = tokens[0], tokens[1]
            sub = out[rows]
            sub[:, token_ids] = (h.to(token_rows.dtype) @ token_rows.t()).to(out.dtype)
            out.index_copy_(0, rows, sub)


def wrap_vocab_for_lora(
    model: nn.Module, names: list[str], max_loras: int, max_lora_rank: int, dtype: torch.dtype | None
) -> dict[str, EmbeddingWithLoRA | HeadWithLoRA]:
    """Replace the model's vocab modules `names` (an nn.Embedding, a Linear head) in place; idempotent."""
    wrapped: dict[str, EmbeddingWithLoRA | HeadWithLoRA] = {}
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, EmbeddingWithLoRA | HeadWithLoRA):
            wrapped[name] = module
            continue
        layer: EmbeddingWithLoRA | HeadWithLoRA
        if isinstance(module, nn.Embedding):
            layer = EmbeddingWithLoRA(module, max_loras, max_lora_rank, dtype)
        elif isinstance(module, Linear):
            layer = HeadWithLoRA(module, max_loras, max_lora_rank, dtype)
        else:
            raise TypeError(f"{name}: {type(module).__name__} is no vocab module")
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)
        wrapped[name] = layer
    return wrapped
