"""A `loraserve serve` child process for the benchmarks that drive a real server: start, wait, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, flags: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`loraserve serve --host 127.0.0.1 --port PORT *flags`, its output in `log_path`; `env` adds to
    (and overrides) this process's environment."""
    command = [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *flags]
    full_env = {**os.environ, "LORASERVE_LOGGING_LEVEL": "WARNING", **(env or {})}
    with open(log_path, "w", encoding="utf-8") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, env=full_env, stdout=subprocess.DEVNULL, stderr=log)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see its log")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not come up")


def stop_server(process: subprocess.Popen, timeout_s: float = 120) -> int:
    """SIGTERM (a graceful drain), then SIGKILL if it is still there after `timeout_s`; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@contextmanager
def running_server(flags: list[str], log_path: str, env: dict[str, str] | None = None,
                   port: int | None = None) -> Iterator[str]:
    """A healthy server for the duration of the block; yields its base URL."""
    port = port or free_port()
    process = start_server(port, flags, log_path, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        yield url
    finally:
        stop_server(process)
