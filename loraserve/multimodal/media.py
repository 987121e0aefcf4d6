"""Image sources and decoding: a request's image URL to a checked, decoded RGB image.

Sources, as vLLM reads them: `data:image/...;base64,...`; `file://` paths inside
--allowed-local-media-path (the path resolved, symlinks included, before it is checked, so no name
escapes the folder; refused without the flag); http(s) URLs fetched within IMAGE_FETCH_TIMEOUT from
the request to the last byte (a server trickling bytes cannot hold a request longer), at most
`max_image_bytes` read, hosts limited to --allowed-media-domains when given (redirects too).

Decoding: PIL reads the header first; an image declaring more than `max_image_pixels` (a
decompression bomb) is refused before a pixel is decoded; only common raster formats are opened
(PNG, JPEG, WebP, GIF, BMP, TIFF: no format that runs an external program); a truncated or corrupt
file, or one that is not an image, is refused. Every refusal is a `MediaError` (the client's 400);
the caller names the message part. Fetching is async (the event loop's); decoding and the file and
data reads are CPU or disk work, run off the loop by the caller.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
import time
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

# httpx at import, not on the first http image URL: that import took 160 ms on the event loop, and a
# partly imported httpx in sys.modules broke a client in the same process that looked it up meanwhile.
import httpx
from PIL import Image, UnidentifiedImageError

from loraserve import envs

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_CHUNK = 64 << 10
_MAX_REDIRECTS = 5


class MediaError(ValueError):
    """An image a request cannot use: what is wrong, for the client (no server paths)."""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 25_000_000
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] | None = None

    @classmethod
    def from_config(cls, config: Any) -> MediaLimits:
        """From a `MultiModalConfig`."""
        return cls(
            config.max_image_bytes,
            config.max_image_pixels,
            config.allowed_local_media_path,
            tuple(config.allowed_media_domains) if config.allowed_media_domains is not None else None,
        )


def url_kind(url: str) -> str:
    """ "data", "file" or "http"; MediaError for any other scheme."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return "data"
    if scheme == "file":
        return "file"
    if scheme in ("http", "https"):
        return "http"
    raise MediaError(
        "the image URL must be a data: URL (base64), a file:// URL or an http(s) URL, "
        f"got scheme {scheme or 'none'!r}"
    )


def read_data_url(url: str, limits: MediaLimits) -> bytes:
    """The bytes of `data:image/<type>;base64,<payload>`."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("the data: URL has no ',' before its payload")
    media_type, *params = header[len("data:") :].split(";")
    if not media_type.lower().startswith("image/"):
        raise MediaError(f"the data: URL's media type must be image/*, got {media_type or 'none'!r}")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaError("the data: URL must be base64-encoded (data:image/png;base64,...)")
    if len(payload) > 4 * (limits.max_image_bytes // 3 + 1) + 4:
        raise MediaError(f"the image is larger than {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data: URL's payload is not valid base64 ({exc})") from None


def read_local_file(url: str, limits: MediaLimits) -> bytes:
    """A file:// URL's bytes, from inside --allowed-local-media-path only."""
    if not limits.allowed_local_media_path:
        raise MediaError("file:// image URLs need the server to be started with --allowed-local-media-path")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError("a file:// image URL must name a local path (file:///path)")
    root = os.path.realpath(limits.allowed_local_media_path)
    path = os.path.realpath(unquote(parsed.path))
    if os.path.commonpath([root, path]) != root or path == root:
        raise MediaError(
            "the file:// image URL must name a file inside the server's --allowed-local-media-path"
        )
    try:  # O_NOFOLLOW: a symlink swapped in after the check above is not followed
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise MediaError("the file:// image URL names no readable file") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a folder, a FIFO, a device: never read
        os.close(fd)
        raise MediaError("the file:// image URL does not name a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > limits.max_image_bytes:
            raise MediaError(f"the image is larger than {limits.max_image_bytes} bytes")
        data = f.read(limits.max_image_bytes + 1)
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"the image is larger than {limits.max_image_bytes} bytes")
    return data


def read_local_source(url: str, limits: MediaLimits) -> bytes:
    """The bytes of a data: or file:// URL (disk or CPU work: call it off the event loop)."""
    return read_data_url(url, limits) if url_kind(url) == "data" else read_local_file(url, limits)


def _check_host(url: str, limits: MediaLimits) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise MediaError("the image URL must be an http(s) URL with a host")
    domains = limits.allowed_media_domains
    if domains is not None and parsed.hostname.lower() not in {d.lower() for d in domains}:
        raise MediaError(
            f"the image URL's host {parsed.hostname!r} is not in the server's --allowed-media-domains"
        )


async def fetch_http(url: str, limits: MediaLimits, timeout: float | None = None) -> bytes:
    """An http(s) image's bytes within the fetch timeout (whole download) and the byte limit."""
    seconds = envs.image_fetch_timeout() if timeout is None else timeout
    try:
        return await asyncio.wait_for(_download(url, limits, seconds), seconds)
    except asyncio.TimeoutError:
        raise MediaError(f"the image URL did not deliver the image within {seconds:g} s") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"the image URL could not be fetched ({type(exc).__name__})") from None


async def _download(url: str, limits: MediaLimits, seconds: float) -> bytes:
    async with httpx.AsyncClient(follow_redirects=False, timeout=seconds) as client:
        for _ in range(_MAX_REDIRECTS + 1):
            _check_host(url, limits)
            async with client.stream("GET", url) as response:
                if response.is_redirect and "location" in response.headers:
                    url = str(response.url.join(response.headers["location"]))
                    continue
                _check_response(response, limits)
                data = bytearray()
                async for chunk in response.aiter_bytes(_CHUNK):
                    data += chunk
                    if len(data) > limits.max_image_bytes:
                        raise MediaError(f"the image is larger than {limits.max_image_bytes} bytes")
                return bytes(data)
    raise MediaError(f"the image URL redirects more than {_MAX_REDIRECTS} times")


def fetch_http_sync(url: str, limits: MediaLimits, timeout: float | None = None) -> bytes:
    """`fetch_http` for callers without an event loop (`LLM.chat`): the same limits, the deadline
    checked before each read and bounding it."""
    seconds = envs.image_fetch_timeout() if timeout is None else timeout
    deadline = time.monotonic() + seconds

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MediaError(f"the image URL did not deliver the image within {seconds:g} s")
        return remaining

    try:
        with httpx.Client(follow_redirects=False, timeout=left()) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                _check_host(url, limits)
                with client.stream("GET", url, timeout=left()) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = str(response.url.join(response.headers["location"]))
                        continue
                    _check_response(response, limits)
                    data = bytearray()
                    for chunk in response.iter_bytes():  # as the reads come: the deadline between them
                        left()
                        data += chunk
                        if len(data) > limits.max_image_bytes:
                            raise MediaError(f"the image is larger than {limits.max_image_bytes} bytes")
                    left()
                    return bytes(data)
            raise MediaError(f"the image URL redirects more than {_MAX_REDIRECTS} times")
    except httpx.TimeoutException:
        raise MediaError(f"the image URL did not deliver the image within {seconds:g} s") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"the image URL could not be fetched ({type(exc).__name__})") from None


def _check_response(response: Any, limits: MediaLimits) -> None:
    if response.status_code != 200:
        raise MediaError(f"the image URL answered HTTP {response.status_code}")
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
        raise MediaError(f"the image is larger than {limits.max_image_bytes} bytes")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """The image in `data` as RGB, decoded only if its header declares at most `max_image_pixels`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
                if width <= 0 or height <= 0:
                    raise MediaError(f"the image declares an empty size {width}x{height}")
                if width * height > limits.max_image_pixels:
                    raise MediaError(
                        f"the image is {width}x{height} = {width * height} pixels, more than the "
                        f"{limits.max_image_pixels} allowed"
                    )
                image.seek(0)  # an animation's first frame
                return image.convert("RGB")  # decodes: a truncated or corrupt file raises here
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError(
            f"the image declares more than the {limits.max_image_pixels} pixels allowed"
        ) from None
    except UnidentifiedImageError:
        raise MediaError(f"the data is not an image in a supported format ({', '.join(FORMATS)})") from None
    except Exception as exc:  # noqa: BLE001 - PIL raises many types on corrupt data: all the client's
        raise MediaError(f"the image could not be decoded ({_short(exc)})") from None


def _short(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
