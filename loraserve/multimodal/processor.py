"""`MultiModalProcessor`: a prompt's text and images through the model's Hugging Face processor, into
the `MultiModalInputs` the engine runs.

The processor is the model's own (`AutoProcessor`, PIL backend: the image processors' PIL/numpy path,
so torchvision is never needed). Processors that also hold a video processor (Qwen2-VL, SmolVLM)
cannot be built where torchvision is missing (its absence makes transformers' video-processor class
check fail), so they are built with their image processor and tokenizer and no video processor: the
same class, the same image and text code, videos refused. The processor expands each image's
placeholder into its tokens; its replacement strings give how many embedding tokens each image has,
and the prompt's placeholder positions are split among the images in order (their total must equal
the number of placeholder tokens, else the prompt held placeholder text of its own: a ValueError).

Thread-safe for concurrent `process` calls (the processor and tokenizer are only read); CPU work, run
on the serving layer's tokenizer pool.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from PIL import Image

from loraserve.multimodal.families import FAMILIES, ImageFamily, image_token_id
from loraserve.multimodal.inputs import ImageItem, MultiModalInputs, content_hash
from loraserve.multimodal.media import MediaLimits
from loraserve.multimodal.mrope import mrope_positions

logger = logging.getLogger(__name__)
_NOT_FEATURES = {
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "mm_token_type_ids",
    "text_replacement_offsets",
}


def takes_images(architecture: str) -> bool:
    return architecture in FAMILIES


def load_hf_processor(model_path: str, trust_remote_code: bool = False) -> Any:
    """The model's processor with its PIL image processor (see the module docstring)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code, backend="pil")
    except (AttributeError, ImportError, ValueError, TypeError) as exc:
        logger.info("AutoProcessor failed (%s); building the processor without a video processor", exc)
    return _images_only_processor(model_path, trust_remote_code)


def _images_only_processor(model_path: str, trust_remote_code: bool) -> Any:
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if not isinstance(name, str) or not hasattr(transformers, name):
        raise ValueError(f"no processor is known for model_type {config.model_type!r}")
    base = getattr(transformers, name)

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and "video" in argument_name:
                return type(None)
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = base.__name__
    processor_dict, _ = base.get_processor_dict(model_path)
    accepted = set(inspect.signature(base.__init__).parameters) - {"self", "args", "kwargs"}
    extra = {
        k: v for k, v in processor_dict.items() if k in accepted and k not in ("image_processor", "tokenizer")
    }
    image_processor = AutoImageProcessor.from_pretrained(
        model_path, trust_remote_code=trust_remote_code, backend="pil"
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    kwargs: dict[str, Any] = {"image_processor": image_processor, "tokenizer": tokenizer, **extra}
    if "video_processor" in base.get_attributes():
        kwargs["video_processor"] = None
    return ImagesOnly(**kwargs)


class MultiModalProcessor:
    """Prompts with images for one model: `process(text, images)` -> `MultiModalInputs`."""

    def __init__(
        self,
        model_path: str,
        hf_config: Any,
        architecture: str,
        limits: MediaLimits,
        images_per_prompt: int,
        processor_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        # Pickled as its arguments (`__reduce__`): a --replicas ingress builds its own from the same files.
        self._args = (
            model_path,
            hf_config,
            architecture,
            limits,
            images_per_prompt,
            processor_kwargs,
            trust_remote_code,
        )
        self.family: ImageFamily = FAMILIES[architecture]
        self.architecture = architecture
        self.hf_config = hf_config
        self.limits = limits
        self.images_per_prompt = images_per_prompt
        self.kwargs = dict(processor_kwargs or {})
        self.hf = load_hf_processor(model_path, trust_remote_code)
        self.feature_id = image_token_id(hf_config)
        self.feature_token = self.hf.tokenizer.convert_ids_to_tokens(self.feature_id)
        self.placeholder: str = self.hf.image_token  # what a prompt holds where an image goes

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (MultiModalProcessor, self._args)

    def process(
        self, text: str, images: list[Image.Image], add_special_tokens: bool = True
    ) -> MultiModalInputs:
        """The prompt's ids with each image's placeholder expanded, and each image's encoder inputs,
        hash and positions. ValueError when placeholders and images do not match."""
        if not images:
            raise ValueError("a prompt with images needs at least one image")
        if len(images) > self.images_per_prompt:
            raise ValueError(
                f"at most {self.images_per_prompt} images are allowed per prompt, got {len(images)}"
            )
        out = self.hf(
            text=[text],
            images=[list(images)],
            return_tensors="pt",
            return_text_replacement_offsets=True,
            add_special_tokens=add_special_tokens,
            **self.kwargs,
        )
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        replaced = [r for r in (out.get("text_replacement_offsets") or [[]])[0] if r.get("type") == "image"]
        if len(replaced) != len(images):
            raise ValueError(
                f"the prompt has {len(replaced)} image placeholders ({self.placeholder!r}) for {len(images)} images"
            )
        counts = [r["replacement"].count(self.feature_token) for r in replaced]
        positions = [i for i, token in enumerate(ids) if token == self.feature_id]
        if len(positions) != sum(counts):
            raise ValueError(
                f"the prompt holds {len(positions)} image tokens where its {len(images)} images need "
                f"{sum(counts)}: the text may not contain the image token {self.feature_token!r} itself"
            )
        features = {k: v for k, v in out.items() if k not in _NOT_FEATURES and isinstance(v, torch.Tensor)}
        per_image = self.family.split(features, counts, self.hf_config)
        items, start = [], 0
        for data, count in zip(per_image, counts, strict=True):
            items.append(ImageItem(content_hash(data), data, _runs(positions[start : start + count])))
            start += count
        mrope, delta = (None, 0)
        if self.family.mrope:
            mrope, delta = mrope_positions(len(ids), items, self.hf_config)
        return MultiModalInputs(ids, tuple(items), mrope, delta, self.family.bidirectional)


def _runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return tuple(runs)
