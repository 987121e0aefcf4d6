"""Images in chat messages: each `image_url` part found, checked against the model and the limits,
fetched and decoded, before the prompt is rendered.

A model that takes no images refuses a request with one, naming the model (never answering as if
the images were not there); more images than --limit-mm-per-prompt allows is a 400 before anything is
fetched. Each part's URL is read (`multimodal.media`: data:, file:// under
--allowed-local-media-path, http(s) within the fetch timeout) and decoded with the pixel limit; every
refusal is a 400 naming the part (`messages[i].content[j]`). Reading a file or a data: URL and
decoding run off the event loop (the tokenizer pool, in the client's turn); http fetches are the
event loop's own async I/O. Several images are loaded at once; the first refusal cancels the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.multimodal.media import (
    MediaError,
    MediaLimits,
    decode_image,
    fetch_http,
    read_local_source,
    url_kind,
)

OffLoop = Callable[..., Awaitable[Any]]  # runs fn(*args) off the event loop (the tokenizer pool)


@dataclass(frozen=True, slots=True)
class ImagePart:
    message: int
    part: int
    url: str

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def image_parts(messages: Sequence[Any]) -> list[ImagePart]:
    """The `image_url` parts of the messages, in order; 400 for one without a URL."""
    found = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            where = f"messages[{i}].content[{j}]"
            if not isinstance(url, str) or not url:
                raise APIError(
                    f'{where}: an image_url part needs {{"image_url": {{"url": ...}}}} with a data:, file:// '
                    "or http(s) URL.",
                    HTTPStatus.BAD_REQUEST,
                    where,
                )
            found.append(ImagePart(i, j, url))
    return found


def check_image_parts(parts: list[ImagePart], processor: Any, model_name: str) -> None:
    """400 when the model takes no images or the prompt has more than the limit allows."""
    if not parts:
        return
    if processor is None:
        raise APIError(
            f"The model {model_name!r} takes text only, and {parts[0].where} is an image: it cannot read "
            "images. Send the request to a vision-language model.",
            HTTPStatus.BAD_REQUEST,
            parts[0].where,
        )
    limit = processor.images_per_prompt
    if len(parts) > limit:  # vLLM's text, then where
        raise APIError(
            f"At most {limit} image(s) may be provided in one prompt; this request has {len(parts)} "
            f"({parts[limit].where} is one too many).",
            HTTPStatus.BAD_REQUEST,
            parts[limit].where,
        )


async def load_images(parts: list[ImagePart], limits: MediaLimits, off_loop: OffLoop) -> list[Any]:
    """The parts' images, decoded (PIL RGB), in order; an APIError (400) naming the first part that fails."""

    async def one(part: ImagePart) -> Any:
        try:
            if url_kind(part.url) == "http":
                data = await fetch_http(part.url, limits)
            else:
                data = await off_loop(read_local_source, part.url, limits)
            return await off_loop(decode_image, data, limits)
        except MediaError as exc:
            raise APIError(f"{part.where}: {exc}.", HTTPStatus.BAD_REQUEST, part.where) from None

    tasks = [asyncio.ensure_future(one(part)) for part in parts]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
