"""Image sources and decoding (loraserve/multimodal/media.py): data: URLs, file:// paths that cannot
leave --allowed-local-media-path, http(s) fetched within the timeout and the byte limit from allowed
hosts only, and PIL decoding that refuses a decompression bomb from its header (no pixel decoded), a
truncated file and what is not an image."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image, ImageFile
from support.slow_http import trickle
from support.tiny_vlm import forged_png

from loraserve.multimodal.media import (
    MediaError,
    MediaLimits,
    decode_image,
    fetch_http,
    fetch_http_sync,
    read_data_url,
    read_local_file,
    url_kind,
)


def png(width: int = 16, height: int = 12, color: tuple[int, int, int] = (200, 10, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


LIMITS = MediaLimits(max_image_bytes=1 << 20, max_image_pixels=1_000_000)


def test_decodes_a_data_url_to_rgb() -> None:
    image = decode_image(read_data_url(data_url(png(16, 12)), LIMITS), LIMITS)
    assert image.mode == "RGB" and image.size == (16, 12) and image.getpixel((3, 3)) == (200, 10, 30)


@pytest.mark.parametrize(
    "url, message",
    [
        (data_url(b"hello", "text/plain"), "media type must be image/"),
        ("data:image/png,notbase64", "must be base64"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64", "no ','"),
        (data_url(b"\0" * (2 << 20)), "larger than"),
    ],
)
def test_refuses_bad_data_urls(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        read_data_url(url, LIMITS)


def test_refuses_unknown_schemes() -> None:
    assert [url_kind(u) for u in ("data:x", "FILE:///a", "https://h/x")] == ["data", "file", "http"]
    with pytest.raises(MediaError, match="scheme 'ftp'"):
        url_kind("ftp://host/x.png")


def test_a_bomb_is_refused_from_its_header_before_any_pixel_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_decoding(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(MediaError, match=r"2000x600 = 1200000 pixels, more than the 1000000 allowed"):
        decode_image(forged_png(2000, 600), LIMITS)
    # 30000 x 30000: PIL's own guard (at twice its MAX_IMAGE_PIXELS) refuses it while reading the header.
    with pytest.raises(MediaError, match="more than the 1000000 pixels allowed"):
        decode_image(forged_png(30000, 30000), LIMITS)
    monkeypatch.undo()
    with pytest.raises(MediaError, match="2000x600"):  # a real one, equally
        decode_image(png(2000, 600), LIMITS)


def test_truncated_corrupt_and_unsupported_files_are_refused() -> None:
    whole = png(64, 64, (1, 2, 3))
    with pytest.raises(MediaError, match="could not be decoded"):
        decode_image(whole[: len(whole) // 2], LIMITS)
    with pytest.raises(MediaError, match="not an image in a supported format"):
        decode_image(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", LIMITS)  # EPS: never opened
    with pytest.raises(MediaError, match="not an image"):
        decode_image(b"hello world", LIMITS)


def test_an_animation_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buf.getvalue(), LIMITS).getpixel((1, 1)) == (255, 0, 0)


def test_file_urls_stay_inside_the_allowed_folder(tmp_path: Any) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(png())
    (outside / "key.png").write_bytes(png())
    os.symlink(outside / "key.png", allowed / "link.png")  # a name inside pointing outside
    os.symlink(outside, allowed / "dir")
    (allowed / "sub").mkdir()
    limits = MediaLimits(max_image_bytes=1 << 20, allowed_local_media_path=str(allowed))
    assert read_local_file(f"file://{allowed}/ok.png", limits) == png()
    for url in (
        f"file://{allowed}/link.png",
        f"file://{allowed}/dir/key.png",
        f"file://{allowed}/../secret/key.png",
        f"file://{outside}/key.png",
        f"file://{allowed}",
    ):
        with pytest.raises(MediaError, match="inside the server's --allowed-local-media-path"):
            read_local_file(url, limits)
    with pytest.raises(MediaError, match="not name a regular file"):
        read_local_file(f"file://{allowed}/sub", limits)
    with pytest.raises(MediaError, match="no readable file"):
        read_local_file(f"file://{allowed}/missing.png", limits)
    with pytest.raises(MediaError, match="need the server to be started with --allowed-local-media-path"):
        read_local_file(f"file://{allowed}/ok.png", MediaLimits())
    with pytest.raises(MediaError, match="larger than 10 bytes"):
        read_local_file(
            f"file://{allowed}/ok.png", MediaLimits(max_image_bytes=10, allowed_local_media_path=str(allowed))
        )


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/ok.png":
            self._send(png())
        elif self.path == "/slow.png":  # trickles: each byte within any read timeout, the whole never
            trickle(self, 100)
        elif self.path == "/big.png":
            self._send(b"\0" * (2 << 20))
        elif self.path == "/away":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/ok.png")
            self.end_headers()
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_images_within_the_timeout_the_size_and_the_hosts(image_host: str) -> None:
    assert asyncio.run(fetch_http(f"{image_host}/ok.png", LIMITS, timeout=5)) == png()
    assert fetch_http_sync(f"{image_host}/ok.png", LIMITS, timeout=5) == png()
    for fetch in (
        lambda url: asyncio.run(fetch_http(url, LIMITS, timeout=0.5)),
        lambda url: fetch_http_sync(url, LIMITS, timeout=0.5),
    ):
        started = time.monotonic()
        with pytest.raises(MediaError, match="within 0.5 s"):
            fetch(f"{image_host}/slow.png")
        assert time.monotonic() - started < 5  # the whole download is bounded, not each read
        with pytest.raises(MediaError, match="larger than"):
            fetch(f"{image_host}/big.png")
        with pytest.raises(MediaError, match="HTTP 404"):
            fetch(f"{image_host}/missing.png")
    only_ip = MediaLimits(max_image_bytes=1 << 20, allowed_media_domains=("127.0.0.1",))
    assert asyncio.run(fetch_http(f"{image_host}/ok.png", only_ip, timeout=5)) == png()
    with pytest.raises(MediaError, match="host 'localhost' is not in the server's --allowed-media-domains"):
        asyncio.run(
            fetch_http(f"{image_host}/away", only_ip, timeout=5)
        )  # the redirect's host is checked too
