"""One JSON depth bound for every parse path, on a live server (the fake engine: no tokens needed):
a body nesting too deep (in any route, /invocations included), a schema or a past tool call's
arguments given as a string nesting too deep, are each a 400 naming the field, at once, with no
traceback in the log, while a neighbour's request is served as before.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from support.fake_server_fixtures import expected_ids
from support.harness import RunningServer

from loraserve.json_limits import MAX_JSON_DEPTH

BOUND_S = 5.0


def _nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _raw(server: RunningServer, path: str, text: str) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = server.http.post(path, content=text, headers={"Content-Type": "application/json"})
    return response, time.monotonic() - start


CHAT = {"model": "base", "max_tokens": 3}
USER = {"role": "user", "content": "hi"}


def _past_call(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        USER,
    ]


CASES = [
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [USER],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": json.loads(_nested_arrays(500))},
            },
        },
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [USER],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": _nested_schema(400)},
            },
        },
        "response_format",
    ),
    ("/v1/completions", {"model": "base", "prompt": "x", "guided_json": _nested_arrays(1000)}, "guided_json"),
    (
        "/v1/completions",
        {"model": "base", "prompt": "x", "structured_outputs": {"json": _nested_arrays(100_000)}},
        "structured_outputs",
    ),
    (
        "/v1/completions",
        {
            "model": "base",
            "prompt": "x",
            "structural_tag": json.dumps(
                {
                    "structures": [
                        {"begin": "<a>", "schema": json.loads(_nested_arrays(200)), "end": "</a>"}
                    ],
                    "triggers": ["<a>"],
                }
            ),
        },
        "structural_tag",
    ),
    ("/v1/chat/completions", {**CHAT, "messages": _past_call(_nested_arrays(100_000))}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[c[2] + str(i) for i, c in enumerate(CASES)])
def test_too_deep_is_a_400_naming_the_field(
    server: RunningServer, caplog: pytest.LogCaptureFixture, path: str, body: dict, param: str
) -> None:
    caplog.set_level(logging.INFO)
    start = time.monotonic()
    response = server.http.post(path, json=body)
    elapsed = time.monotonic() - start
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, response.text
    assert "levels" in error["message"] and f"at most {MAX_JSON_DEPTH}" in error["message"], error
    assert elapsed < BOUND_S
    assert not [r for r in caplog.records if r.exc_info], "a client's mistake logged a traceback"
    neighbour = server.http.post(
        "/v1/completions", json={"model": "base", "prompt": [7, 8, 9], "max_tokens": 3}
    )
    assert neighbour.json()["choices"][0]["text"] == server.engine.tokenizer.decode(
        expected_ids(server, [7, 8, 9], 3)
    )


@pytest.mark.parametrize("path", ["/invocations", "/v1/completions", "/tokenize", "/v1/load_lora_adapter"])
def test_a_body_of_brackets_is_a_400_in_every_route(server: RunningServer, path: str) -> None:
    response, elapsed = _raw(server, path, "[" * 100_000)
    assert response.status_code == 400 and "nests 100000 levels" in response.json()["error"]["message"]
    assert elapsed < BOUND_S


def test_just_within_the_bound_is_served(server: RunningServer) -> None:
    schema = json.dumps(_nested_schema((MAX_JSON_DEPTH - 1) // 2))  # a string: its own depth counts
    response = server.http.post(
        "/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2, "guided_json": schema}
    )
    assert response.status_code == 200, response.text
