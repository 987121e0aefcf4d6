"""`loraserve serve <argv>` run in-process, exactly as the command line runs it, for tests of whole
command lines: the parser, the launcher, the engine and uvicorn, on a background thread.

The uvicorn server is captured when the launcher creates it, so the test can stop it as SIGTERM would
(signals only reach the main thread).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from support.harness import wait_for


@contextmanager
def live_serve(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Run `loraserve serve *argv` until the block ends; yields the started uvicorn server."""
    from loraserve.entrypoints import cli
    from loraserve.entrypoints.openai.cli import launcher
    from loraserve.entrypoints.openai.server import http_server

    servers: list[Any] = []
    real_build = http_server.build_server

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        servers.append(real_build(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(http_server, "build_server", recording_build)
    monkeypatch.setattr(launcher, "configure_logging", lambda: None)  # keep pytest's logging setup
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(cli.main(["serve", *argv])), daemon=True)
    thread.start()
    wait_for(lambda: bool(status) or (bool(servers) and servers[0].started), 120, "the server to start")
    assert not status, f"serve exited with status {status} before serving"
    try:
        yield servers[0]
    finally:
        servers[0].should_exit = True
        thread.join(60)
        servers.clear()  # the patched build_server outlives the block until teardown: drop the engine now
    assert status == [0], status
