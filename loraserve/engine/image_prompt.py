"""A prompt's images, as `LLMEngine.add_request` takes them: vLLM's `multi_modal_data` (PIL images
beside a text prompt holding the model's image placeholders, run through the model's processor here),
or `multi_modal_inputs` the serving layer has already processed (off the event loop, on its tokenizer
pool). A model that takes no images refuses both by name: never answered as if the images were not
there."""

from __future__ import annotations

from typing import Any

from loraserve.multimodal.inputs import MultiModalInputs
from loraserve.multimodal.processor import MultiModalProcessor


def takes_no_images(architecture: str) -> ValueError:
    return ValueError(
        f"The model ({architecture}) takes text only: this request has image inputs, which it cannot "
        "read. Send it to a vision-language model."
    )


def image_inputs(
    prompt: Any, processor: MultiModalProcessor | None, architecture: str
) -> MultiModalInputs | None:
    """The prompt's processed images (None for a text prompt); ValueError for images the model or
    the prompt cannot take."""
    if not isinstance(prompt, dict) or not ("multi_modal_data" in prompt or "multi_modal_inputs" in prompt):
        return None
    if processor is None:
        raise takes_no_images(architecture)
    given = prompt.get("multi_modal_inputs")
    if given is not None:
        if not isinstance(given, MultiModalInputs):
            raise ValueError("multi_modal_inputs must be a MultiModalInputs (the processor's output).")
        return given
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(
            "multi_modal_data must be a dict with an 'image' entry (one image or a list); only images are served."
        )
    images = data.get("image")
    images = images if isinstance(images, (list, tuple)) else [images]
    from PIL import Image

    if not images or not all(isinstance(image, Image.Image) for image in images):
        raise ValueError("multi_modal_data['image'] must be a PIL image or a list of them.")
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError(
            "a prompt with images must be text ('prompt') holding the model's image placeholder "
            f"{processor.placeholder!r} once per image: its processor expands them."
        )
    return processor.process(text, [image.convert("RGB") for image in images])
