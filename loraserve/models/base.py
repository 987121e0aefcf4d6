"""What every native causal LM shares: declarative weight loading, logits, KV-cache shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.layers.linear import Linear
from loraserve.layers.quant.embedding import QuantEmbedding
from loraserve.layers.quant.formats import QuantTensor


class NativeCausalLM(nn.Module):
    """Base for native models. Subclasses set the class attributes and build `self.lm_head`.

    `packed_modules_mapping` says which checkpoint tensors are stacked into one packed layer
    (shard order = list order); `transposed_weight_modules` lists layers whose checkpoint stores
    [in, out] (GPT-2's Conv1D); `ignored_weight_suffixes` are checkpoint buffers to skip.
    """

    is_native = True
    loads_quantized = True  # `load_weights` takes QuantTensor checkpoint tensors (kept quantized in Linears)
    packed_modules_mapping: dict[str, list[str]] = {}
    transposed_weight_modules: tuple[str, ...] = ()
    ignored_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    lm_head: Linear
    tie_word_embeddings: bool = False

    def _build_lm_head(self, embedding: nn.Embedding, vocab_size: int, tie: bool, dtype: torch.dtype) -> None:
        """The output projection; with tied embeddings it shares the input embedding's weight."""
        self.lm_head = Linear(embedding.embedding_dim, vocab_size, dtype=dtype)
        self.tie_word_embeddings = tie
        if tie:
            self.lm_head.weight = cast(nn.Parameter, embedding.weight)

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError  # each architecture states its own cache shape

    def vocab_lora_modules(self) -> dict[str, nn.Module]:
        """The vocab modules adapters may carry LoRA, trainable tokens or a saved copy of, by full
        name (`lora/vocab_layers.py` wraps them); none unless the architecture routes the step's
        batch through them (its forward passes it to the embedding, its `compute_logits` takes `lora`)."""
        return {}

    def compute_logits(
        self, hidden: torch.Tensor, float32: bool = True, lora: LoRABatchMapping | None = None
    ) -> torch.Tensor:
        """Logits [N, vocab] in float32, or with float32=False in the LM head's dtype (no copy: the
        sampler converts the rows it computes on, and greedy rows need none). `lora`: the mapping of
        these rows, for a head that takes adapter terms (`HeadWithLoRA`, only then passed)."""
        head: Any = self.lm_head  # a HeadWithLoRA where adapters may carry head terms
        logits = (
            head.logits(hidden, lora)
            if getattr(head, "takes_lora_rows", False)
            else head.base_forward(hidden)
        )
        return logits.float() if float32 else logits

    def _packed_target(self, name: str) -> tuple[str, int | None]:
        """Map a checkpoint parameter name to (model parameter name, packed shard index or None)."""
        parts = name.split(".")
        if len(parts) >= 2:
            for packed, shards in self.packed_modules_mapping.items():
                if parts[-2] in shards:
                    parts[-2] = packed
                    return ".".join(parts), shards.index(name.split(".")[-2])
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the model; every model parameter must be provided once."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(self.ignored_weight_suffixes):
                continue
            name, shard = self._packed_target(ckpt_name)
            module_name, _, leaf = name.rpartition(".")
            module = modules.get(module_name)
            if isinstance(tensor, QuantTensor) and isinstance(module, nn.Embedding) and leaf == "weight":
                self._keep_quantized_embedding(module_name, module, tensor)
                loaded.add(name)
                continue
            if isinstance(tensor, QuantTensor):
                # A tied LM head may still get its own quantized copy (GGUF's token_embd, kept quantized).
                if not isinstance(module, Linear) or leaf != "weight" or module_name.endswith(self.transposed_weight_modules):
                    tensor = tensor.dequantize()
                else:
                    module.load_quant_shard(tensor, shard)
                    loaded.add(name if shard is None else f"{name}#{shard}")
                    continue
            if self.tie_word_embeddings and ckpt_name.startswith("lm_head."):
                continue
            if isinstance(module, Linear):
                if module_name.endswith(self.transposed_weight_modules) and leaf == "weight":
                    tensor = tensor.t()
                module.load_shard(leaf, tensor.to(module.weight.dtype), shard)
            elif name in params:
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"shape mismatch for {ckpt_name}: model {tuple(param.shape)}, "
                        f"checkpoint {tuple(tensor.shape)}"
                    )
                param.data.copy_(tensor.to(param.dtype))
            else:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}")
            loaded.add(name if shard is None else f"{name}#{shard}")
        self._check_all_loaded(loaded)
        for module in modules.values():
            if isinstance(module, Linear):
                module.finish_loading()

    def _keep_quantized_embedding(
        self, module_name: str, embedding: nn.Embedding, tensor: QuantTensor
    ) -> None:
        """A quantized embedding table stays in its blocks (`QuantEmbedding` in the embedding's place);
        a tied LM head runs the quantized kernel on the same blocks, so the table is held once."""
        if tuple(embedding.weight.shape) != tensor.shape:
            raise ValueError(
                f"shape mismatch for {module_name}.weight: model {tuple(embedding.weight.shape)}, "
                f"checkpoint {tensor.shape}"
            )
        if self.tie_word_embeddings and self.lm_head.weight is embedding.weight:
            self.lm_head.load_quant_shard(tensor, None)
            head = self.lm_head.quant_parts[0] if self.lm_head.quant_parts is not None else None
            tensor = tensor if head is None else head.tensor  # the kernel's layout, held once for both
        quantized = QuantEmbedding(tensor, embedding.weight.dtype)
        parent_name, _, child = module_name.rpartition(".")
        setattr(self.get_submodule(parent_name) if parent_name else self, child, quantized)

    def _check_all_loaded(self, loaded: set[str]) -> None:
        missing = []
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                if self.tie_word_embeddings and module is self.lm_head:
                    continue
                num_shards = len(module.output_sizes)
                keys = [f"{name}.weight"] if num_shards == 1 else [f"{name}.weight#{i}" for i in range(num_shards)]
                missing += [k for k in keys if k not in loaded]
        for name, _ in self.named_parameters(recurse=True):
            module_name = name.rpartition(".")[0]
            if not isinstance(self.get_submodule(module_name), Linear) and name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
