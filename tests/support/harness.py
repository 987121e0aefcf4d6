"""Server test harness: a real uvicorn server on 127.0.0.1:<free port> in a background thread.

`RunningServer(engine, options)` serves `build_app(engine, options)` with any `EngineClient` (the real
AsyncLLMEngine, or support.fake_engine.FakeEngine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from loraserve.entrypoints.openai.server.api_server import ServerOptions, build_app
from loraserve.entrypoints.openai.server.http_server import LoraserveServer, build_server


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Wait until `predicate()` holds (a state the test caused, not a guess about timing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class RunningServer:
    """uvicorn serving `build_app(engine, options)` on 127.0.0.1:<free port> in its own thread and loop."""

    def __init__(self, engine: Any, options: ServerOptions) -> None:
        self.engine = engine
        if options.shutdown_timeout_s == ServerOptions().shutdown_timeout_s:
            # Tests that do not study shutdown should not wait 30 s for requests they left open.
            options = dataclasses.replace(options, shutdown_timeout_s=1.0)
        self.options = options
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app: Any = None
        self.server: LoraserveServer | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self._http: Any = None
        self.thread = threading.Thread(target=self._run, name=f"server-{self.port}", daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        self.ready.wait(60)
        if self.error is not None:
            raise self.error
        assert self.server is not None and self.server.started, "server did not start"
        return self

    @property
    def http(self) -> Any:
        """A keep-alive httpx client for this server (creating one per request costs ~0.1 s)."""
        import httpx

        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=30)
        return self._http

    def __exit__(self, *exc: object) -> None:
        if self._http is not None:
            self._http.close()
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the test thread
            self.error = exc
        finally:
            self.ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.engine.start()
        try:
            self.app = await build_app(self.engine, self.options)
            self.server = build_server(self.app, self.options, self.engine)
            serving = asyncio.create_task(self.server.serve(sockets=[self.sock]))
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.005)
            self.ready.set()
            await serving
        finally:
            await self.engine.shutdown()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (sync or returning a coroutine) on the server's event loop and return its result."""
        assert self.loop is not None

        async def run() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def sse_events(self, path: str, body: dict, headers: dict | None = None) -> list[Any]:
        """POST a streaming request and return its events: parsed JSON objects, and "[DONE]"."""
        import httpx

        events: list[Any] = []
        with httpx.stream("POST", self.url + path, json=body, headers=headers, timeout=30) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events

    def begin_shutdown(self) -> None:
        """What SIGTERM does to uvicorn: ask the serve loop to exit."""
        assert self.server is not None
        self.call(lambda: setattr(self.server, "should_exit", True))


def stream_events_into(url: str, body: dict, sink: list[Any]) -> None:
    """Stream `body` to /v1/completions, appending the status code and then each event (parsed JSON,
    or "[DONE]") to `sink` as it arrives, so a test in another thread sees how far the stream got."""
    import httpx

    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        sink.append(response.status_code)
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                sink.append(data if data == "[DONE]" else json.loads(data))
