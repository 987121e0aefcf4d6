"""`loraserve serve` as a child process on a free port: start it, wait until /health answers, stop it.

The wait follows the server's progress, not the clock alone: a server still logging (loading, Ray
scheduling its replicas, which on a loaded machine takes minutes) is given time, one that stays silent
for `startup_timeout_s` is not, and none waits past `max_startup_s`. So a busy test machine slows the
suite without failing it, and a hung server still fails in bounded time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

CLI = [sys.executable, "-m", "loraserve.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`with ServeProcess([MODEL, flags...]) as server:` ... `server.stop()` -> (exit status, output)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout_s: float = 90,
                 max_startup_s: float = 900) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.max_startup_s = max_startup_s
        # read as it grows, and at the end; closed by stop()
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # noqa: SIM115
        self.process = subprocess.Popen(
            [*CLI, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "LORASERVE_LOGGING_LEVEL": "INFO", **(env or {})},
        )
        self.output: str | None = None

    def _logged(self) -> int:
        return os.fstat(self._log.fileno()).st_size

    def __enter__(self) -> ServeProcess:
        start = last_progress = time.monotonic()
        logged = 0
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited at startup:\n{self.stop()[1]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            now = time.monotonic()
            size = self._logged()
            if size > logged:
                logged, last_progress = size, now
            if now - last_progress > self.startup_timeout_s or now - start > self.max_startup_s:
                self.stop()
                raise AssertionError(f"the server did not come up in {now - start:.0f} s (silent for "
                                     f"{now - last_progress:.0f} s):\n{self.output}")  # fmt: skip
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> tuple[int, str]:
        if self.output is None:
            if self.process.poll() is None:
                self.process.send_signal(sig)
            self.process.wait(timeout=timeout_s)
            self._log.seek(0)
            self.output = self._log.read()
            self._log.close()
        return self.process.returncode, self.output

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.stop()
