"""`VisionLanguageModel`: what every vision-language model shares (LLaVA, LLaVA-NeXT, Gemma-3,
Idefics3 / SmolVLM, Qwen2-VL / Qwen2.5-VL).

Its language model is a native decoder (`LlamaModel`, `GemmaModel`) that places the image embeddings
over the placeholder tokens' rows (`ForwardBatch.embeds`), so text and image requests, base and
adapters, run in one batch through the same kernels and LoRA ops. Its vision tower and connector are
transformers' own modules: the HF base model of the architecture (`LlavaModel`, ...) is built with a
language model of no layers, which is then dropped, and its remaining children are registered here
under their HF names; `encode_images` calls that model's own `get_image_features`. Their `nn.Linear`s
become `HFLinear`s (packed for the CPU kernels like any linear; LoRA-capable with
--enable-tower-connector-lora, reading a one-adapter mapping from `tower_binding` while it encodes).

Names are transformers' current ones (`model.language_model.layers.0...`, `model.vision_tower...`,
`lm_head`): checkpoint tensors and adapter module names are mapped onto them by transformers' own
conversion mapping for the architecture (older checkpoints say `language_model.model.layers.0...`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch, StepBinding, UniformSlot
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.models.base import NativeCausalLM
from loraserve.models.hf_linears import convert_linears
from loraserve.multimodal.families import image_token_id


def _shrunk(hf_config: Any) -> Any:
    """A copy of the config whose language model has no layers and a one-token vocabulary."""
    config = copy.deepcopy(hf_config)
    text = config.get_text_config()
    text.num_hidden_layers = 0
    text.vocab_size = 2
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = []
    return config


def build_vision_parts(hf_class: str, hf_config: Any, dtype: torch.dtype, language_attr: str) -> nn.Module:
    """transformers' base model `hf_class` with its vision tower and connector only (the language
    model it builds from the shrunk config is dropped)."""
    import transformers

    cls = getattr(transformers, hf_class)
    model = cls._from_config(_shrunk(hf_config), dtype=dtype)
    delattr(model, language_attr)
    return model.eval()


def checkpoint_renamer(hf_class: str, hf_config: Any) -> Callable[[str], str]:
    """Checkpoint (or adapter module) name -> transformers' current name for architecture `hf_class`,
    by its conversion mapping, read from a parameter-free (meta) build of the shrunk config."""
    import transformers

    from loraserve.models.transformers_fallback import checkpoint_renamer as renamer

    with torch.device("meta"):
        model = getattr(transformers, hf_class)._from_config(_shrunk(hf_config))
    return functools.lru_cache(maxsize=None)(renamer(model, model.state_dict(keep_vars=True)))


class VisionLanguageModel(NativeCausalLM):
    """Subclasses set the class attributes, build the language model (`_language_model`) and encode
    (`_encode`); see the module docstring."""

    takes_images: ClassVar[bool] = True
    hf_vision_class: ClassVar[str]  # transformers' base model holding the vision parts ("LlavaModel")
    hf_class: ClassVar[str]  # the checkpoint's class, whose conversion mapping renames its tensors
    language_attr: ClassVar[str] = "language_model"  # the language model's name under `model`
    bidirectional_images: ClassVar[bool] = False  # an image's tokens attend to each other both ways
    uses_mrope: ClassVar[bool] = False  # positions are [3, T] (Qwen2-VL's M-RoPE)
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # Buffers some checkpoints hold that the modules compute (rope tables, CLIP's position ids).
    ignored_weight_suffixes = ("rotary_emb.inv_freq", "position_ids")
    args: Any  # the language model's LlamaArgs / GemmaArgs
    vision: Any  # transformers' base model holding the vision parts (not a registered child)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.hf_config = hf_config
        text = hf_config.get_text_config()
        language, self.args = self._language_model(text, dtype)
        self.model = nn.Module()
        self.model.add_module(self.language_attr, language)
        vision = build_vision_parts(self.hf_vision_class, hf_config, dtype, self.language_attr)
        prefixes = []
        for name, child in vision.named_children():
            self.model.add_module(name, child)
            prefixes.append(f"model.{name}.")
        for name, param in vision.named_parameters(recurse=False):
            param.requires_grad_(False)
            self.model.register_parameter(name, param)
            prefixes.append(f"model.{name}")
        self.tower_module_prefixes: tuple[str, ...] = tuple(prefixes)
        object.__setattr__(self, "vision", vision)  # its children are ours (registered above), not it
        self.tower_binding = StepBinding()
        convert_linears(vision, self.tower_binding)
        embedding = cast(nn.Embedding, language.embed_tokens)
        self._build_lm_head(embedding, self.args.vocab_size, self.args.tie_word_embeddings, dtype)
        self.image_token_id = image_token_id(hf_config)
        self.architecture_name = self.hf_class
        self._rename = checkpoint_renamer(self.hf_class, hf_config)
        self._language_prefix = f"model.{self.language_attr}."

    def _language_model(self, text_config: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        raise NotImplementedError  # each architecture builds its own

    @property
    def language_model(self) -> nn.Module:
        return self.model.get_submodule(self.language_attr)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, batch)

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.args
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.sliding_window)

    def canonical_module_name(self, name: str) -> str:
        """An adapter's (or checkpoint's) module name as this model names it."""
        return self._rename(name)

    # ---- images ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_images(
        self, items: Sequence[Mapping[str, torch.Tensor]], uniform: UniformSlot | None = None
    ) -> list[torch.Tensor]:
        """Each image's embeddings [its placeholder tokens, hidden] in the model dtype, in order.
        `uniform`: the one adapter slot whose tower/connector terms apply (None: the base tower)."""
        self.tower_binding.uniform = uniform
        try:
            embeddings = self._encode(items)
        finally:
            self.tower_binding.uniform = None
        dtype = self.lm_head.weight.dtype
        return [e.reshape(-1, e.shape[-1]).to(dtype) for e in embeddings]

    def _encode(self, items: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        raise NotImplementedError  # each architecture calls its HF model's get_image_features

    def _vision_dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.vision.parameters() if p.is_floating_point())

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield self._rename(name), tensor

    def _packed_target(self, name: str) -> tuple[str, int | None]:
        """Only the language model's q/k/v and gate/up are packed; the tower keeps its own layout."""
        if not name.startswith(self._language_prefix):
            return name, None
        return super()._packed_target(name)


def cat_field(items: Sequence[Mapping[str, torch.Tensor]], key: str, dim: int = 0) -> torch.Tensor:
    return torch.cat([item[key] for item in items], dim=dim)
