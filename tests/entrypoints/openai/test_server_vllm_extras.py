"""vLLM's extra request fields: honoured, or refused with a 400 that names the field, never ignored.

Every field of the table gets a value that asks for something (refused) and its "off" value (vLLM's
default, accepted), on both endpoints; new OpenAI fields stay accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.entrypoints.openai.serving.vllm_extras import EXTRAS

ASKING: dict[str, Any] = {
    "logits_processors": ["my.module:Processor"],
    "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"k": 1},
    "prompt_embeds": "AAAA",
    "add_special_tokens": "flip",  # the endpoint's own default is accepted, see below
    "mm_processor_kwargs": {"fps": 1},
    "media_io_kwargs": {"video": {}},
    "reasoning_effort": "high",
    "include_reasoning": False,
}
BODIES = {
    "/v1/completions": {"model": "base", "prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "base",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
}


def test_every_extra_has_a_case() -> None:
    assert set(ASKING) == set(EXTRAS)


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_an_extra_that_asks_for_something_is_refused_by_name(server, path: str, name: str) -> None:
    value = ASKING[name]
    if name == "add_special_tokens":
        value = "chat" in path  # the other endpoint's default
    response = server.http.post(path, json={**BODIES[path], name: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["message"].startswith(f"{name} is not supported")


@pytest.mark.parametrize("path", list(BODIES))
def test_off_values_and_new_openai_fields_are_accepted(server, path: str) -> None:
    is_chat = "chat" in path
    off = {
        name: (extra.chat_off if is_chat and extra.chat_off else extra.off)[-1]
        for name, extra in EXTRAS.items()
    }
    off.update(length_penalty=1, store=False, metadata={"team": "x"}, spaces_between_special_tokens=False)
    response = server.http.post(path, json={**BODIES[path], **off})
    assert response.status_code == 200, response.text
