"""What needs a real `loraserve serve` process (signals reach only a main thread), one process for the
module (tiny random Llama, an --api-key-file beside --api-key, a compile timeout far away):
- SIGHUP re-reads the key file: the new key works, the removed one is refused, --api-key keys stay;
- a client that disconnects while its runaway regex compiles has the compile withdrawn and its worker
  killed;
- SIGTERM while runaway compiles run and wait exits 0 within --shutdown-timeout plus the drain's
  margin: no compile is waited for (it used to stay alive 90 s after "Finished server process").
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.harness import wait_for
from support.serve_process import ServeProcess

RUNAWAY = ".*" * 2000  # minutes of compiling (test_hostile_grammars.py says why)
PLAIN = "sk-plain"  # --api-key: reaches everything
SHUTDOWN_TIMEOUT_S = 1


def _keys(path: Path, key: str) -> None:
    path.write_text(json.dumps({"keys": [{"key": key, "label": "customer", "base_model": True}]}))


@pytest.fixture(scope="module")
def process(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    _keys(key_file, "sk-first")
    flags = [
        tiny_model("llama"),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--served-model-name",
        "base",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--structured-outputs-compile-timeout",
        "600",
        "--api-key-file",
        str(key_file),
        "--api-key",
        PLAIN,
    ]
    with ServeProcess(flags) as running:
        yield running, key_file


def _status(process: ServeProcess, key: str) -> int:
    return httpx.get(
        process.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
    ).status_code


def _metric(process: ServeProcess, name: str) -> float:
    text = httpx.get(process.url + "/metrics", headers={"Authorization": f"Bearer {PLAIN}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"loraserve:{name} "):
            return float(line.split()[-1])
    return 0.0


def _send(process: ServeProcess, regex: str) -> socket.socket:
    """A completion request with this guided_regex, sent on a raw connection the test can drop."""
    body = json.dumps({"model": "base", "prompt": "x", "max_tokens": 4, "guided_regex": regex}).encode()
    sock = socket.create_connection(("127.0.0.1", process.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {PLAIN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_sighup_reloads_the_key_file(process: tuple[ServeProcess, Path]) -> None:
    server, key_file = process
    assert (_status(server, "sk-first"), _status(server, "sk-second"), _status(server, PLAIN)) == (
        200,
        401,
        200,
    )
    _keys(key_file, "sk-second")
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: _status(server, "sk-second") == 200, 30, "the new key after SIGHUP")
    assert (_status(server, "sk-first"), _status(server, PLAIN)) == (401, 200)


def test_a_client_that_leaves_takes_its_compile_down_and_sigterm_waits_for_none(
    process: tuple[ServeProcess, Path],
) -> None:
    server, _ = process
    leaving = _send(server, RUNAWAY)
    wait_for(lambda: _metric(server, "grammar_compiles_running") == 1, 60, "its compile to start")
    leaving.close()
    wait_for(lambda: _metric(server, "grammar_compiles_cancelled_total") == 1, 10, "the compile withdrawn")
    wait_for(lambda: _metric(server, "grammar_compiles_running") == 0, 10, "its worker killed")
    # Both from one client (one key): one compiles, the other waits for the key's share.
    staying = [_send(server, RUNAWAY + "c" * i) for i in range(2)]
    wait_for(
        lambda: (
            _metric(server, "grammar_compiles_running") == 1
            and _metric(server, "grammar_compiles_queued") == 1
        ),
        60,
        "one compile running, one queued",
    )
    start = time.monotonic()
    status, output = server.stop(signal.SIGTERM, timeout_s=30)
    elapsed = time.monotonic() - start
    for sock in staying:
        sock.close()
    assert status == 0, output
    assert elapsed < SHUTDOWN_TIMEOUT_S + 10, (elapsed, output)
    assert "Traceback" not in output and "sk-first" not in output and "sk-second" not in output, output
