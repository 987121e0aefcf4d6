"""No request fails its neighbours, on a live server (tiny random Llama): beam searches with a
length_penalty whose power overflows are served, NaN numbers are 400s naming their field, extreme
but valid numbers are served, and a request whose own sampling raises gets its 500 alone while the
requests beside it finish with the output they give alone.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from support.harness import RunningServer

from loraserve.engine.sampler import Sampler
from loraserve.entrypoints.openai.server.api_server import ServerOptions

POISON_SEED = 666
NEIGHBOURS = [
    {"prompt": f"neighbour {i}", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True} for i in range(4)
]


@pytest.fixture(scope="module")
def server(tiny_model: Any):
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model("llama"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20
        )
    )
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as running:
        yield running


def _post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "base", **body}, timeout=60)


def _raw(server: RunningServer, text: str) -> httpx.Response:
    """A body as written (Python's json writes NaN, which strict clients never send)."""
    return httpx.post(
        server.url + "/v1/completions", content=text, headers={"Content-Type": "application/json"}, timeout=60
    )


def _texts(responses: list[httpx.Response]) -> list[str]:
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


def _beside_neighbours(
    server: RunningServer, bodies: list[dict[str, Any]]
) -> tuple[list[httpx.Response], list[str]]:
    """`bodies` and the neighbours, all at once; the neighbours' texts must equal their texts alone."""
    alone = _texts([_post(server, body) for body in NEIGHBOURS])
    with ThreadPoolExecutor(len(bodies) + len(NEIGHBOURS)) as pool:
        futures = [pool.submit(_post, server, body) for body in [*bodies, *NEIGHBOURS]]
        responses = [f.result() for f in futures]
    assert _texts(responses[len(bodies) :]) == alone
    return responses[: len(bodies)], alone


def test_beam_searches_with_an_overflowing_length_penalty_are_served(server: RunningServer) -> None:
    beams = [
        {"prompt": f"beam {i}", "use_beam_search": True, "n": 2, "max_tokens": 4, "length_penalty": penalty}
        for i, penalty in enumerate([1e308, -1e308, 1e308, 1e300, -1e300, 1e308])
    ]
    responses, _ = _beside_neighbours(server, beams)
    assert [r.status_code for r in responses] == [200] * len(beams), [r.text for r in responses]
    assert all(len(r.json()["choices"]) == 2 for r in responses)


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ('{"model": "base", "prompt": "x", "logit_bias": {"7": NaN}}', "logit_bias"),
        ('{"model": "base", "prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
        ('{"model": "base", "prompt": "x", "temperature": NaN}', "temperature"),
        (
            '{"model": "base", "prompt": "x", "length_penalty": NaN, "use_beam_search": true, "n": 2}',
            "length_penalty",
        ),
        ('{"model": "base", "prompt": "x", "repetition_penalty": -1}', "repetition_penalty"),
    ],
)
def test_bad_numbers_are_400s_naming_the_field(server: RunningServer, text: str, param: str) -> None:
    response = _raw(server, text)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_extreme_valid_numbers_are_served_beside_neighbours(server: RunningServer) -> None:
    extremes = [
        {"prompt": "a", "max_tokens": 4, "repetition_penalty": 1e308},
        {"prompt": "b", "max_tokens": 4, "repetition_penalty": 1e-300},
        {"prompt": "c", "max_tokens": 4, "temperature": 1e308},
        {"prompt": "d", "max_tokens": 4, "temperature": 1.1e-5, "top_p": 1e-300},
        {"prompt": "e", "max_tokens": 4, "logit_bias": {"7": 1e308, "8": -1e308}},
        {"prompt": "f", "max_tokens": 4, "frequency_penalty": 2.0, "presence_penalty": -2.0},
    ]
    responses, _ = _beside_neighbours(server, extremes)
    assert [r.status_code for r in responses] == [200] * len(extremes), [r.text for r in responses]
    assert json.loads(responses[4].text)["choices"][0]["text"]  # the +100 bias wins every step


def test_a_request_whose_sampling_fails_fails_alone(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Sampler.__call__

    def poisoned(self: Sampler, logits: Any, rows: list[Any]) -> Any:
        if any(row.params.seed == POISON_SEED for row in rows):
            raise RuntimeError("injected fault in one request's sampling")
        return real(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", poisoned)
    culprits = [{"prompt": f"culprit {i}", "max_tokens": 6, "seed": POISON_SEED} for i in range(3)]
    responses, _ = _beside_neighbours(server, culprits)
    for response in responses:
        assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"]
    stats = server.call(lambda: server.engine.stats())
    assert stats["num_step_failures"] == 0 and stats["num_request_failures"] == len(culprits)
