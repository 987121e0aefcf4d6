"""Transformers backend: run any transformers causal LM through loraserve's engine and paged KV cache.

The HF model is built with `attn_implementation="loraserve_paged"` (`hf_attention.py`: every attention
module hands its rotated q/k/v to our paged attention, with the step context this model's `forward`
passes down).

LoRA: the HF model's linear modules are loraserve `Linear`s (`hf_linears.py`) bound to this model's
`StepBinding`, which `forward` sets to the step's ForwardBatch around the HF call. The HF model's
children are registered under their HF names (not under `hf_model.`), so module names are PEFT's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch, StepBinding
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.layers.attention import PagedAttention
from loraserve.models.hf_attention import (
    ATTN_IMPLEMENTATION,
    HOLDER_ATTR,
    STEP_KWARG,
    StepContext,
    StepHolder,
)
from loraserve.models.hf_linears import convert_linears

# Checkpoint buffers that older exports contain but models recompute (rotary tables, causal masks).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
_KNOWN_LAYER_TYPES = {"full_attention", "sliding_attention"}


def kv_cache_spec_from_config(hf_config: Any) -> KVCacheSpec:
    """Cache shape from the (text) config; the attention function re-checks it against real shapes."""
    text = hf_config.get_text_config()
    num_heads = int(text.num_attention_heads)
    num_kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None)
    if num_kv_heads is None:
        num_kv_heads = 1 if getattr(text, "multi_query", False) else num_heads
    head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // num_heads
    layer_types = set(getattr(text, "layer_types", None) or [])
    if not layer_types <= _KNOWN_LAYER_TYPES:
        raise ValueError(
            f"layer_types {sorted(layer_types)}: only {sorted(_KNOWN_LAYER_TYPES)} layers run on the paged KV cache."
        )
    sliding_window = getattr(text, "sliding_window", None)
    if layer_types == {"full_attention"} or getattr(text, "use_sliding_window", True) is False:
        sliding_window = None
    return KVCacheSpec(int(text.num_hidden_layers), int(num_kv_heads), int(head_dim), sliding_window or None)


# Classes transformers flags `_supports_attention_backend=False` whose every attention layer still calls
# the AttentionInterface (their modeling code dispatches through ALL_ATTENTION_FUNCTIONS); the per-step
# count of attention calls in `forward` would catch one that did not.
_ATTENTION_INTERFACE_ANYWAY = frozenset({"StableLmForCausalLM"})


def _backend_compatible(cls: Any) -> bool:
    return bool(cls.is_backend_compatible()) or cls.__name__ in _ATTENTION_INTERFACE_ANYWAY


def _incompatible_error(arch: str) -> ValueError:
    return ValueError(
        f"transformers' {arch} does not support custom attention backends (_supports_attention_backend=False), "
        "so it cannot run on loraserve's paged KV cache; use a natively supported architecture."
    )


def _build_hf_model(hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """The HF causal LM for the first listed architecture transformers knows, with our attention."""
    import transformers
    from transformers import AutoModelForCausalLM

    from loraserve.models.registry import remote_code_arch, transformers_knows

    kwargs = {"dtype": dtype, "attn_implementation": ATTN_IMPLEMENTATION}
    remote_arch = remote_code_arch(hf_config)
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch == remote_arch:
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=True, **kwargs)
        if transformers_knows(arch) and hasattr(transformers, arch):
            cls = getattr(transformers, arch)
            if not _backend_compatible(cls):
                raise _incompatible_error(arch)
            return cls._from_config(hf_config, **kwargs)
    return AutoModelForCausalLM.from_config(hf_config, **kwargs)


def checkpoint_renamer(hf_model: Any, targets: dict[str, torch.Tensor]) -> Callable[[str], str]:
    """Checkpoint name -> model name, with transformers' own renamings (e.g. GPT-NeoX embed_out -> lm_head)
    and base-model prefix handling; tensors that transformers would merge or split are refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers 4.x: checkpoints load under their saved names
        prefix = hf_model.base_model_prefix + "."
        return lambda name: name if name in targets or prefix + name not in targets else prefix + name

    transforms = get_model_conversion_mapping(hf_model)
    renamings: list[Any] = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters: list[Any] = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> str:
        renamed, converter_pattern = rename_source_key(
            name, renamings, converters, hf_model.base_model_prefix, targets
        )
        if converter_pattern is not None:
            raise ValueError(
                f"checkpoint tensor {name!r} needs transformers' {converter_pattern!r} conversion (tensors merged "
                "or split on load), which the transformers backend does not perform."
            )
        return renamed

    return rename


class TransformersForCausalLM(nn.Module):
    """Any transformers causal LM behind loraserve's model interface, LoRA on its linear modules."""

    is_native = False
    packed_modules_mapping: dict[str, list[str]] = {}
    hf_model: Any  # a transformers PreTrainedModel

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        # transformers writes dtype and attention choice into the config; keep the caller's untouched.
        self.hf_config = copy.deepcopy(hf_config)
        self.model_dtype = dtype
        hf_model = _build_hf_model(self.hf_config, dtype)
        if not _backend_compatible(type(hf_model)):
            raise _incompatible_error(type(hf_model).__name__)
        self.architecture_name = type(hf_model).__name__
        self.step_binding = StepBinding()
        converted = convert_linears(hf_model, self.step_binding)
        self._transposed = converted.transposed
        self.packed_modules_mapping = converted.packed_modules_mapping
        self._step_holder = StepHolder()
        for module in hf_model.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                object.__setattr__(module, HOLDER_ATTR, self._step_holder)
        # Not a child: its children are, so that module names are the HF model's (and PEFT's).
        object.__setattr__(self, "hf_model", hf_model)
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self._spec = kv_cache_spec_from_config(self.hf_config)
        self._kernels: dict[int, PagedAttention] = {}

    def train(self, mode: bool = True) -> TransformersForCausalLM:
        super().train(mode)
        self.hf_model.training = mode
        return self

    def kv_cache_spec(self) -> KVCacheSpec:
        return self._spec

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """input_ids/positions [T] (many sequences, flat) -> hidden [T, H]."""
        step = StepContext(kv_caches, batch.attn, self._kernels, self._spec.sliding_window)
        # What the LoRA layers (and kwargs-less attention calls) read; cleared even if the forward fails.
        self.step_binding.batch, self._step_holder.step = batch, step
        try:
            out = self.hf_model.base_model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                **{STEP_KWARG: step},
            )
        finally:
            self.step_binding.batch, self._step_holder.step = None, None
        if step.num_calls != len(kv_caches):
            raise ValueError(
                f"{type(self.hf_model).__name__} ran paged attention {step.num_calls} times for {len(kv_caches)} "
                "layers: its attention does not go through transformers' AttentionInterface."
            )
        if self._spec.sliding_window is not None and step.num_sliding_calls == 0:
            raise ValueError(
                f"config sets sliding_window={self._spec.sliding_window} but no layer of "
                f"{type(self.hf_model).__name__} passed it to the attention function, so the window cannot be applied."
            )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits [N, vocab] in float32 (whatever `float32` says: the scalings and softcap below run
        in float32), with the output scalings some HF heads apply after lm_head."""
        logits = self.hf_model.get_output_embeddings()(hidden)
        text = self.hf_config.get_text_config()
        if getattr(text, "logit_scale", None) is not None:
            logits = logits * text.logit_scale
        if getattr(text, "logits_scaling", None) is not None:
            logits = logits / text.logits_scaling
        cap = getattr(text, "final_logit_softcapping", None)
        logits = logits.float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by HF name; every parameter (tied ones once) must be provided."""
        targets = self.hf_model.state_dict(keep_vars=True)
        rename = checkpoint_renamer(self.hf_model, targets)
        loaded: set[int] = set()
        for name, tensor in weights:
            target_name = rename(name)
            if target_name not in targets:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                raise ValueError(
                    f"checkpoint tensor {name!r} matches nothing in {type(self.hf_model).__name__}."
                )
            target = targets[target_name]
            if target_name in self._transposed:  # a Conv1D weight: [in, out] in the checkpoint
                tensor = tensor.t()
            if target.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name}: model {tuple(target.shape)}, checkpoint {tuple(tensor.shape)}."
                )
            with torch.no_grad():
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            loaded.add(id(target))
        missing = [name for name, param in self.hf_model.named_parameters() if id(param) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}.")
