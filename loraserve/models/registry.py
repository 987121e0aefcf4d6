"""Model registry: architecture name -> implementation class, resolved lazily.

The table maps the names found in `config.json`'s `architectures` to `(module, class)` pairs that are
imported only when chosen, so resolving (or listing) architectures never imports torch model code.
Architectures without a native implementation can run through the transformers backend
(`TransformersForCausalLM`) when transformers itself knows them as causal LMs. `describe()` lists both,
with what takes adapters and what takes images (the `loraserve models` command and docs/models.md
print it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from loraserve.multimodal.families import FAMILIES

MODEL_IMPLS = ("auto", "native", "transformers")

_NATIVE_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("loraserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("loraserve.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("loraserve.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("loraserve.models.qwen", "Qwen3ForCausalLM"),
    "GPT2LMHeadModel": ("loraserve.models.gpt2", "GPT2LMHeadModel"),
    "GemmaForCausalLM": ("loraserve.models.gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("loraserve.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("loraserve.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("loraserve.models.gemma3", "Gemma3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("loraserve.models.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("loraserve.models.llava", "LlavaNextForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("loraserve.models.idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("loraserve.models.idefics3", "SmolVLMForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("loraserve.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("loraserve.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "MixtralForCausalLM": ("loraserve.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("loraserve.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("loraserve.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("loraserve.models.olmoe", "OlmoeForCausalLM"),
    "Phi3ForCausalLM": ("loraserve.models.phi3", "Phi3ForCausalLM"),
}
_TRANSFORMERS_BACKEND = ("loraserve.models.transformers_fallback", "TransformersForCausalLM")


@dataclass(frozen=True)
class ResolvedArchitecture:
    """Which listed architecture was chosen and whether it runs natively or via transformers."""

    arch_name: str
    is_native: bool


def register_model(arch_name: str, target: str | type[nn.Module]) -> None:
    """Add or replace a native architecture; `target` is a class or "package.module:ClassName" (plugins)."""
    if isinstance(target, str):
        module_name, sep, class_name = target.partition(":")
        if not sep or not module_name or not class_name:
            raise ValueError(f"register_model target must be 'module:ClassName', got {target!r}.")
        _NATIVE_MODELS[arch_name] = (module_name, class_name)
        return
    _NATIVE_MODELS[arch_name] = (target.__module__, target.__qualname__)


def get_supported_archs() -> list[str]:
    """Architecture names with a native implementation, sorted."""
    return sorted(_NATIVE_MODELS)


@dataclass(frozen=True, slots=True)
class ArchitectureSupport:
    """One row of `describe()`: how an architecture runs, where its LoRA adapters apply, and whether
    its requests may bring images (a vision-language model)."""

    architecture: str
    implementation: str  # "native" or "transformers"
    lora: str
    images: bool = False


# Where adapters apply, by implementation (both serve them in mixed batches with PEFT's outputs; an
# adapter on any other module is refused at load by name, and a model with no LoRA-capable module at
# all is refused at startup with --enable-lora, in one line).
NATIVE_LORA = "q/k/v/o and gate/up/down (q/k/v and gate/up adapters as slices of the packed layers)"
_NATIVE_LORA_NOTES = {
    "GPT2LMHeadModel": "c_attn, attn.c_proj, c_fc, mlp.c_proj (Conv1D, fan_in_fan_out)",
    "Phi3ForCausalLM": "qkv_proj, o_proj, gate_up_proj, down_proj as in the checkpoint; adapters on "
    "q/k/v or gate/up apply as slices of the fused layers",
}
# Vision-language models: images in; LoRA on the language model, the tower and connector with a flag.
_VISION_LORA = (
    f"the language model's {NATIVE_LORA}; the vision tower's and connector's linears with "
    "--enable-tower-connector-lora"
)
VISION_LANGUAGE = frozenset(FAMILIES)  # the architectures whose processor side loraserve knows
_NATIVE_LORA_NOTES.update({name: _VISION_LORA for name in VISION_LANGUAGE})
TRANSFORMERS_LORA = "its nn.Linear and Conv1D modules (not the vocab projection, not MoE experts)"


def describe(include_transformers: bool = True) -> list[ArchitectureSupport]:
    """What runs natively, what runs on the transformers backend (every causal LM the installed
    transformers knows that has no native implementation), and where each takes adapters."""
    rows = [
        ArchitectureSupport(
            name, "native", _NATIVE_LORA_NOTES.get(name, NATIVE_LORA), name in VISION_LANGUAGE
        )
        for name in get_supported_archs()
    ]
    if include_transformers:
        others = sorted(_transformers_causal_lm_names() - set(_NATIVE_MODELS))
        rows += [ArchitectureSupport(name, "transformers", TRANSFORMERS_LORA) for name in others]
    return rows


def describe_markdown() -> str:
    """docs/models.md's table: the native architectures, then a line for the transformers backend
    (whose list follows the installed transformers: `loraserve models --all` prints it)."""
    lines = ["| Architecture | Runs | Images | LoRA adapters on |", "| --- | --- | --- | --- |"]
    lines += [
        f"| `{r.architecture}` | native | {'yes' if r.images else 'no'} | {r.lora} |"
        for r in describe(include_transformers=False)
    ]
    lines += [
        "",
        "Every other causal LM the installed transformers knows runs on the transformers backend "
        f"(`loraserve models --all` lists them, text only), adapters on {TRANSFORMERS_LORA}. "
        "Images: docs/vision.md.",
    ]
    return "\n".join(lines) + "\n"


def _normalize_native(name: str) -> str | None:
    """The registered spelling of `name`: exact, else whitespace-stripped, else a unique case-insensitive match."""
    stripped = name.strip()
    if stripped in _NATIVE_MODELS:
        return stripped
    matches = [arch for arch in _NATIVE_MODELS if arch.lower() == stripped.lower()]
    return matches[0] if len(matches) == 1 else None


def _transformers_causal_lm_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def remote_code_arch(hf_config: Any) -> str | None:
    """The class name the repo's own code registers for AutoModelForCausalLM, if any."""
    auto_map = getattr(hf_config, "auto_map", None) or {}
    ref = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
    if isinstance(ref, (list, tuple)):
        ref = ref[0] if ref else None
    return ref.rsplit(".", 1)[-1] if isinstance(ref, str) else None


def transformers_knows(arch_name: str, hf_config: Any = None) -> bool:
    """True when the transformers backend can build this architecture as a causal LM."""
    name = arch_name.strip()
    if name in _transformers_causal_lm_names():
        return True
    return hf_config is not None and name == remote_code_arch(hf_config)


def _unsupported_error(architectures: Sequence[str], model_impl: str) -> ValueError:
    listed = list(architectures)
    problem = (
        "The model config lists no `architectures`"
        if not listed
        else f"None of the model's architectures {listed} can be resolved with model_impl={model_impl!r}"
    )
    native = ", ".join(get_supported_archs())
    if model_impl == "native":
        backend = "Pass model_impl='transformers' to run a causal LM that transformers implements."
    else:
        backend = "Other causal LMs known to transformers run through the transformers backend."
    return ValueError(
        f"{problem}. Supported native architectures: {native}. {backend} If the checkpoint is one of these "
        "under another name (or lacks the field), set it explicitly: "
        'hf_overrides={"architectures": ["LlamaForCausalLM"]} '
        '(CLI: --hf-overrides \'{"architectures": ["LlamaForCausalLM"]}\').'
    )


def resolve_architecture(
    architectures: Sequence[str] | None, model_impl: str = "auto", *, hf_config: Any = None
) -> ResolvedArchitecture:
    """Choose the implementation without importing it.

    "auto": the first listed architecture with a native implementation, else the first one transformers
    knows (transformers backend). "native": native only. "transformers": the backend, for the first
    architecture transformers knows. Order in `architectures` decides between several candidates.
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {list(MODEL_IMPLS)}, got {model_impl!r}.")
    names = [str(name) for name in (architectures or [])]
    if model_impl in ("auto", "native"):
        for name in names:
            native = _normalize_native(name)
            if native is not None:
                return ResolvedArchitecture(native, is_native=True)
    if model_impl in ("auto", "transformers"):
        for name in names:
            if transformers_knows(name, hf_config):
                return ResolvedArchitecture(name.strip(), is_native=False)
    raise _unsupported_error(names, model_impl)


def _import_class(module_name: str, class_name: str) -> type[nn.Module]:
    module = importlib.import_module(module_name)
    cls: Any = module
    for part in class_name.split("."):
        cls = getattr(cls, part)
    return cls


def resolve_model_cls(
    architectures: Sequence[str] | None, model_impl: str = "auto", *, hf_config: Any = None
) -> tuple[type[nn.Module], str]:
    """(model class, chosen architecture name); see `resolve_architecture` for the rules."""
    resolved = resolve_architecture(architectures, model_impl, hf_config=hf_config)
    if resolved.is_native:
        return _import_class(*_NATIVE_MODELS[resolved.arch_name]), resolved.arch_name
    return _import_class(*_TRANSFORMERS_BACKEND), resolved.arch_name
