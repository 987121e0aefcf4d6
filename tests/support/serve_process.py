"""`loraserve serve` as a child process on a free port: start it, wait until /health answers, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

CLI = [sys.executable, "-m", "loraserve.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`with ServeProcess([MODEL, flags...]) as server:` ... `server.stop()` -> (exit status, output)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout_s: float = 90) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.process = subprocess.Popen(
            [*CLI, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "LORASERVE_LOGGING_LEVEL": "INFO", **(env or {})},
        )
        self.output: str | None = None

    def __enter__(self) -> ServeProcess:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited at startup:\n{self.process.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not come up:\n{self.output}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> tuple[int, str]:
        if self.output is None:
            if self.process.poll() is None:
                self.process.send_signal(sig)
            self.output, _ = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, self.output

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.stop()
