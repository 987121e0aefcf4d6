"""Images through the OpenAI chat API on a live server (a tiny random LLaVA, an adapter on its
language model): base64 images, streamed and not, with and without the adapter, answered as
transformers / PEFT answer the same rendered prompt and images; every hostile image (a decompression
bomb, a truncated file, a wrong type, too many images, a URL that trickles, a file outside the media
folder) a 400 naming the part, good requests sent at the same time answered as alone, the server
serving on; a text-only model refusing images by name. The
Responses API's `input_image` parts take the same path, its errors naming the input item."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from support.harness import RunningServer
from support.slow_http import trickle
from support.tiny_vlm import forged_png, random_image, save_tiny_vlm
from support.vlm_oracle import generate, peft_vlm, processor_of, save_vlm_adapters

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

NUM_NEW = 5


def png_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class _Trickle(http.server.BaseHTTPRequestHandler):
    """An image host that never finishes: a byte every 0.1 s, each read well within any read timeout."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        trickle(self, 300)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> Iterator[dict[str, Any]]:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    path = str(tmp_path_factory.mktemp("llava"))
    hf = save_tiny_vlm(path, "llava", tokenizer_dir, seed=21)
    adapters = save_vlm_adapters(hf, "llava", str(tmp_path_factory.mktemp("llava-adapters")), path)
    media = tmp_path_factory.mktemp("media")
    random_image(40, 30, 3).save(media / "cat.png")
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=path,
            dtype="float32",
            enable_lora=True,
            max_lora_rank=8,
            kv_cache_memory_bytes=16 << 20,
            limit_mm_per_prompt={"image": 2},
            allowed_local_media_path=str(media),
        )
    )
    options = ServerOptions(served_model_names=["tiny"], lora_modules=[LoRAModulePath("lm", adapters["lm"])])
    trickle = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    trickle.daemon_threads = True
    threading.Thread(target=trickle.serve_forever, daemon=True).start()
    with RunningServer(engine, options) as server:
        yield {
            "server": server,
            "peft": peft_vlm("llava", path, {"lm": adapters["lm"]}),
            "processor": processor_of(path),
            "media": media,
            "slow_url": f"http://127.0.0.1:{trickle.server_address[1]}/slow.png",
        }
    trickle.shutdown()


def _client(stack: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["server"].url + "/v1", api_key="x", max_retries=0)


def _message(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _oracle(
    stack: dict[str, Any], adapter: str | None, parts: list[dict[str, Any]], images: list[Any]
) -> list[int]:
    processor = stack["processor"]
    rendered = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": rendered}], tokenize=False, add_generation_prompt=True
    )
    inputs = dict(processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False))
    return generate(stack["peft"], adapter, inputs, NUM_NEW)[0]


@pytest.mark.parametrize("model", ["tiny", "lm"])
def test_base64_images_through_the_openai_client_streamed_and_not(stack: dict[str, Any], model: str) -> None:
    client = _client(stack)
    images = [random_image(40, 30, 1), random_image(24, 48, 2)]
    parts = [_text("compare "), _image(png_url(images[0])), _text(" and "), _image(png_url(images[1]))]
    kwargs: dict[str, Any] = dict(
        model=model,
        messages=_message(*parts),
        max_tokens=NUM_NEW,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    tokens = whole.choices[0].model_extra["token_ids"]
    assert tokens == _oracle(stack, None if model == "tiny" else "lm", parts, images)
    streamed = client.chat.completions.create(stream=True, **kwargs)
    text, streamed_tokens = "", []
    for chunk in streamed:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed_tokens += chunk.choices[0].model_extra.get("token_ids") or []
    assert text == whole.choices[0].message.content and streamed_tokens == tokens
    assert whole.usage.prompt_tokens > 2 * 16  # two images of 16 tokens each, and the text


def _greedy_tokens(client: openai.OpenAI, model: str, parts: list[dict[str, Any]]) -> list[int]:
    reply = client.chat.completions.create(
        model=model,
        messages=_message(*parts),
        max_tokens=NUM_NEW,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return list(reply.choices[0].model_extra["token_ids"])


def test_the_models_list_says_the_model_takes_images(stack: dict[str, Any]) -> None:
    cards = {card.id: card.model_extra["input_modalities"] for card in _client(stack).models.list().data}
    assert cards == {"tiny": ["text", "image"], "lm": ["text", "image"]}


def test_hostile_images_are_400s_naming_the_part_and_the_server_serves_on(
    stack: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_IMAGE_FETCH_TIMEOUT", "1")
    good = png_url(random_image(20, 20, 5))
    buf = io.BytesIO()
    random_image(64, 64, 6).save(buf, "PNG")
    truncated = "data:image/png;base64," + base64.b64encode(buf.getvalue()[:300]).decode()
    bomb = "data:image/png;base64," + base64.b64encode(forged_png(30000, 30000)).decode()
    cases = [
        ([_text("x"), _image(bomb)], "messages[0].content[1]", "pixels allowed"),
        ([_image(truncated)], "messages[0].content[0]", "could not be decoded"),
        ([_image("data:text/plain;base64,aGVsbG8=")], "messages[0].content[0]", "media type must be image/"),
        ([_image("data:image/png;base64,aGVsbG8=")], "messages[0].content[0]", "not an image"),
        ([_image(good), _image(good), _image(good)], "messages[0].content[2]", "At most 2 image(s)"),
        ([_text("y"), _image(stack["slow_url"])], "messages[0].content[1]", "within 1 s"),
        ([_image("file:///etc/hostname")], "messages[0].content[0]", "allowed-local-media-path"),
    ]
    client = _client(stack)

    def refused(parts: list[dict[str, Any]]) -> tuple[Any, float]:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=_message(*parts), max_tokens=2)
        return error.value.body, time.monotonic() - started

    # Every hostile request at once, beside good requests with images of their own (base and adapter):
    # each hostile one a 400 naming its part, each good one the tokens transformers / PEFT give it.
    images = [random_image(32, 32, 9), random_image(28, 36, 10)]
    good_parts = [[_text("what is "), _image(png_url(image))] for image in images]
    with ThreadPoolExecutor(len(cases) + len(images)) as pool:
        served = [
            pool.submit(_greedy_tokens, client, model, parts)
            for model, parts in zip(("tiny", "lm"), good_parts)
        ]
        answers = [pool.submit(refused, parts) for parts, _, _ in cases]
        for (_, where, message), answer in zip(cases, answers):
            body, seconds = answer.result()
            assert isinstance(body, dict) and body["param"] == where and message in body["message"], body
            assert seconds < 10
        for adapter, parts, image, tokens in zip((None, "lm"), good_parts, images, served):
            assert tokens.result() == _oracle(stack, adapter, parts, [image])
    # Still serving: images from the media folder and from the request.
    media_url = f"file://{stack['media']}/cat.png"
    ok = client.chat.completions.create(
        model="tiny", messages=_message(_image(media_url), _image(good)), max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert stack["server"].http.get("/health").status_code == 200
    metrics = stack["server"].http.get("/metrics").text
    assert "loraserve:images_received_total" in metrics and "loraserve:image_cache_hits_total" in metrics


def test_responses_input_images_are_served_as_chat_images(stack: dict[str, Any]) -> None:
    client = _client(stack)
    images = [random_image(36, 28, 7), random_image(30, 30, 8)]
    urls = [png_url(image) for image in images]
    parts = [_text("compare "), _image(urls[0]), _text(" and "), _image(urls[1])]
    response = client.responses.create(
        model="lm",
        input=[
            {"role": "user", "content": "first turn, text only"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "compare "},
                    {"type": "input_image", "image_url": urls[0], "detail": "auto"},
                    {"type": "input_text", "text": " and "},
                    {"type": "input_image", "image_url": urls[1]},
                ],
            },
        ],
        max_output_tokens=NUM_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    turns = [{"role": "user", "content": "first turn, text only"}, {"role": "user", "content": parts}]
    chat = _client(stack).chat.completions.create(
        model="lm", messages=turns, max_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 2 * 16
    bomb = "data:image/png;base64," + base64.b64encode(forged_png(30000, 30000)).decode()
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(
            model="tiny",
            instructions="be brief",
            input=[
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "input_image", "image_url": bomb}]},
            ],
            max_output_tokens=2,
        )
    body = error.value.body
    assert isinstance(body, dict) and body["param"] == "input[1].content[0]", body
    assert body["message"].startswith("input[1].content[0]: ") and "pixels allowed" in body["message"]


def test_a_text_only_model_refuses_images_by_name(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="base",
            messages=_message(_text("hi"), _image("data:image/png;base64,aGVsbG8=")),
            max_tokens=2,
        )
    body = error.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[1]"
    assert "The model 'base' takes text only" in body["message"]
    assert client.chat.completions.create(model="base", messages=_message(_text("hi")), max_tokens=2).choices
    image = {"type": "input_image", "image_url": "data:image/png;base64,aGVsbG8="}
    for content, message, param in [
        ([{"type": "input_text", "text": "hi"}, image], "takes text only, and input[0].content[1] is an", "input[0].content[1]"),
        ([{"type": "input_image", "file_id": "file_1"}], "input[0].content[0]: images by file_id are not offered", "input"),
    ]:  # fmt: skip
        reply = server.http.post(
            "/v1/responses", json={"model": "base", "input": [{"role": "user", "content": content}]}
        )
        error = reply.json()["error"]
        assert reply.status_code == 400 and message in error["message"] and error["param"] == param, error
