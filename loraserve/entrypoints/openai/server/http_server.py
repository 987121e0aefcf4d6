"""The uvicorn server around the app: connection deadlines, signals, and a shutdown that drains.

- A request's head must arrive within `request_read_timeout_s` of the connection opening (or of the
  previous response on a keep-alive connection); uvicorn alone waits for a trickling head forever.
  The body has the same bound, enforced by `http_guard.RequestGuardMiddleware`.
- SIGTERM or SIGINT starts the drain: the server keeps accepting connections while requests run, so
  a load balancer's health check gets a 503 from `/health` (not a refused connection) and stops
  sending; new requests get a 503 (`/metrics` still answers), and running requests have
  `shutdown_timeout_s` to finish. Then the engine is shut down, so each request still running ends
  with a 503 (a stream: an error event, then `[DONE]`). Once no request runs, the listening socket
  closes and the connections close on their own: nothing is cancelled mid-write, so no tracebacks.
- A dead engine stops the server too; the launcher then exits 1, so a supervisor restarts it.
- SIGHUP re-reads `--api-key-file` (`KeyStore.reload`): new keys and scopes apply to the next
  request, a file that does not load leaves the keys in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from loraserve import envs
from loraserve.entrypoints.openai.server.http_guard import ServerLifecycle
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.errors import EngineDeadError

logger = logging.getLogger("loraserve.server")
# How often the server checks that its engine is alive (polled: the engine has no death callback).
ENGINE_WATCH_INTERVAL_S = 1.0
# uvicorn's own last resort after the drain: it cancels whatever still runs (it should be nothing).
_UVICORN_GRACE_MARGIN_S = 10.0
# How often the drain checks whether requests still run (uvicorn's own shutdown polls every 0.1 s).
_DRAIN_POLL_S = 0.05


def head_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete in time."""

    class HeadDeadlineProtocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE and self._head_deadline is not None:
                self._head_deadline.cancel()  # the head is in: the app (and its body limit) takes over
                self._head_deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(timeout_s, self._head_overdue)

        def _head_overdue(self) -> None:
            self._head_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineProtocol


class LoraserveServer(uvicorn.Server):
    """uvicorn's server with a draining shutdown, and signals handled without re-raising them.

    uvicorn re-raises the signal after its shutdown, which would kill the process before the engine
    is shut down; here the caller finishes the shutdown and the process exits 0.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: ServerLifecycle,
        engine: EngineClient | None,
        shutdown_timeout_s: float,
        on_reload: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_reload = on_reload  # SIGHUP: re-read the key file

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        if self.on_reload is not None:
            reload = self.on_reload
            original[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: reload())
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifecycle.is_draining = True
        logger.info(
            "Shutting down: no new requests; running ones have %g s to finish.", self.shutdown_timeout_s
        )
        expiry = asyncio.create_task(self._end_running_requests())
        try:
            await self._drain()
            await super().shutdown(sockets)
        finally:
            expiry.cancel()

    async def _drain(self) -> None:
        """Wait, still accepting connections (each new request gets a 503), until no request runs.

        The engine's shutdown at `shutdown_timeout_s` ends the engine's requests; a request that
        outlives it even so (stuck outside the engine) is left to uvicorn's own deadline, which gets
        what remains of the drain's budget."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s + _UVICORN_GRACE_MARGIN_S
        while self.lifecycle.active_requests and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        self.config.timeout_graceful_shutdown = max(1, round(deadline - loop.time()))

    async def _end_running_requests(self) -> None:
        await asyncio.sleep(self.shutdown_timeout_s)
        if self.engine is not None:
            logger.warning("Shutdown timeout reached: ending the requests still running with a 503.")
            await self.engine.shutdown()


def build_server(
    app: FastAPI,
    options: Any,
    engine: EngineClient | None = None,
    uvicorn_kwargs: dict[str, Any] | None = None,
) -> LoraserveServer:
    """The server for `app` under `options` (api_server.ServerOptions); `uvicorn_kwargs` are more
    uvicorn.Config keywords (`frontend.uvicorn_options`: TLS, log level, root path)."""
    config = uvicorn.Config(
        app,
        http=head_deadline_protocol(options.request_read_timeout_s),
        log_config=None,
        timeout_keep_alive=max(1, round(options.keep_alive_timeout_s)),
        timeout_graceful_shutdown=round(options.shutdown_timeout_s + _UVICORN_GRACE_MARGIN_S),
        **{"log_level": envs.logging_level().lower(), **(uvicorn_kwargs or {})},
    )
    key_store = getattr(app.state, "key_store", None)
    reload = key_store.reload if key_store is not None and key_store.key_file is not None else None
    return LoraserveServer(config, app.state.lifecycle, engine, options.shutdown_timeout_s, reload)


async def serve_app(
    app: FastAPI,
    sock: socket.socket,
    options: Any,
    engine: EngineClient | None = None,
    uvicorn_kwargs: dict[str, Any] | None = None,
) -> None:
    """Serve `app` on a bound socket until SIGINT/SIGTERM (draining as the module says).

    With `engine`, serving also stops when the engine dies, and EngineDeadError is raised then: a dead
    engine never recovers, and a process that stays up answering 500 is never restarted by a supervisor.
    """
    server = build_server(app, options, engine, uvicorn_kwargs)
    watchdog = asyncio.create_task(stop_when_dead(engine, server)) if engine is not None else None
    try:
        await server.serve(sockets=[sock])
    finally:
        if watchdog is not None:
            watchdog.cancel()
    if engine is not None and engine.errored:
        raise EngineDeadError(
            f"the engine died ({engine.dead_error}); exiting so that a supervisor restarts it"
        )


async def stop_when_dead(
    engine: EngineClient, server: Any, interval: float = ENGINE_WATCH_INTERVAL_S
) -> None:
    """Ask uvicorn to shut down once the engine is dead."""
    while not engine.errored:
        await asyncio.sleep(interval)
    logger.error("The engine is dead (%s); shutting the server down.", engine.dead_error)
    server.should_exit = True
