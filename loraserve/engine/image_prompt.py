"""A prompt's images, as `LLMEngine.add_request` takes them: vLLM's `multi_modal_data` (PIL images
beside a text prompt holding the model's image placeholders, run through the model's processor here),
or `multi_modal_inputs` the serving layer has already processed (off the event loop, on its tokenizer
pool). A model that takes no images refuses both by name: never answered as if the images were not
there. A vision-language checkpoint whose folder has no image processor serves its language model,
images refused. Also the engine's processor itself (`image_processor`) and the one check of a prompt's
images against the step budget (`check_image_runs`), and `prepare_image_prompt`, the engine's
`prepare_prompt` for a prompt that may carry images."""

from __future__ import annotations

import logging
from typing import Any

from loraserve.config import EngineConfig
from loraserve.engine.tokenization import PromptInput, prepare_prompt
from loraserve.multimodal.inputs import MultiModalInputs
from loraserve.multimodal.media import MediaLimits
from loraserve.multimodal.processor import MultiModalProcessor

logger = logging.getLogger(__name__)


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


def prepare_image_prompt(
    prompt: PromptInput,
    processor: MultiModalProcessor | None,
    architecture: str,
    tokenizer: Any,
    config: EngineConfig,
) -> tuple[str | None, list[int], MultiModalInputs | None]:
    """`prepare_prompt` for a prompt that may carry images: (its text, its token ids, its images)."""
    mm = image_inputs(prompt, processor, architecture)
    if mm is None:
        return (*prepare_prompt(prompt, tokenizer, config.model), None)
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    prompt_ids = prepare_prompt(mm.prompt_token_ids, tokenizer, config.model)[1]
    check_image_runs(mm, config.scheduler.max_num_batched_tokens)
    return text, prompt_ids, mm


def check_image_runs(mm: MultiModalInputs, max_num_batched_tokens: int) -> None:
    """Images whose tokens attend to each other both ways are computed in one step: each must fit the
    step's token budget (ValueError otherwise)."""
    longest = max((end - start for start, end in mm.runs()), default=0)
    if mm.bidirectional and longest > max_num_batched_tokens:
        raise ValueError(
            f"An image of this prompt takes {longest} tokens, more than max_num_batched_tokens "
            f"({max_num_batched_tokens}); its tokens must be computed in one step. Raise --max-num-batched-tokens."
        )


def image_processor(model: Any, architecture: str, config: EngineConfig) -> MultiModalProcessor | None:
    """The model's processor for prompts with images (None for a text-only model), checked once on a
    small image so that a broken processor fails at startup, not on the first request."""
    if not getattr(model, "takes_images", False):
        return None
    from PIL import Image

    mm_config = config.multimodal
    try:
        processor = MultiModalProcessor(
            config.model.model_path,
            config.model.hf_config,
            architecture,
            MediaLimits.from_config(mm_config),
            mm_config.images_per_prompt,
            dict(mm_config.mm_processor_kwargs or {}),
            config.model.trust_remote_code,
        )
    except OSError as exc:  # no processor files: the checkpoint is served as the text model it holds
        logger.warning(
            "%s: the model folder has no image processor (%s); serving its language model only: "
            "requests with images are refused.",
            architecture,
            str(exc).splitlines()[0][:200],
        )
        return None
    processor.process(processor.placeholder, [Image.new("RGB", (32, 32), (127, 127, 127))])
    return processor
