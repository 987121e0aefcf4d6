"""Fair batch slots on a live server (tiny random Llama, --max-num-seqs 16, the default share 0.5): a
request whose sequences fill every slot (beam search n=16, best_of 16, n=16 sampling, 4 prompts x 4
beams) no longer holds them while another request waits: a 2-token neighbour sent while it runs
finishes while it is still running, with the output it gives alone, and the big request's own
output is what it gives alone. Which finishes first is checked, not how fast: the big requests
decode 160 tokens, the neighbour 2.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions

SLOTS = 16
NEIGHBOUR = {"prompt": "neighbour", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_tokens": 160, "ignore_eos": True}
BIG = {
    "beams": {"prompt": "big", "use_beam_search": True, "n": SLOTS, **LONG},
    "best_of": {"prompt": "big", "use_beam_search": True, "n": 1, "best_of": SLOTS, **LONG},
    "samples": {"prompt": "big", "n": SLOTS, "seed": 5, "temperature": 0.9, **LONG},
    "prompts": {"prompt": ["a", "b", "c", "d"], "use_beam_search": True, "n": 4, **LONG},
}


@pytest.fixture(scope="module")
def server(tiny_model: Any):
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model("llama"),
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=32 << 20,
            max_num_seqs=SLOTS,
        )
    )
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as running:
        yield running


def _complete(server: RunningServer, body: dict[str, Any]) -> list[str]:
    response = httpx.post(server.url + "/v1/completions", json={"model": "base", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def _running(server: RunningServer) -> int:
    return int(server.call(lambda: server.engine.stats())["num_running"])


@pytest.mark.parametrize("kind", list(BIG))
def test_a_request_filling_every_slot_does_not_hold_a_neighbour(server: RunningServer, kind: str) -> None:
    big_alone = _complete(server, BIG[kind])
    neighbour_alone = _complete(server, NEIGHBOUR)
    result: list[list[str]] = []
    big = threading.Thread(target=lambda: result.append(_complete(server, BIG[kind])), daemon=True)
    big.start()
    wait_for(lambda: _running(server) == SLOTS or not big.is_alive(), 60, "the big request to fill the slots")
    assert big.is_alive(), "the big request ended before the neighbour was sent"
    assert _complete(server, NEIGHBOUR) == neighbour_alone
    assert big.is_alive()  # the neighbour finished first: it did not wait for the whole big request
    big.join(120)
    assert result == [big_alone]
