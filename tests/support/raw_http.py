"""HTTP over a plain socket, for what client libraries will not send (HTTP/9.9, a whole body in one
write before reading) and for telling a response from a connection reset."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RawReply:
    data: bytes  # everything received before the server closed (or reset) the connection
    reset: bool  # the connection was reset (sending or receiving) rather than closed

    @property
    def status(self) -> int | None:
        parts = self.data.split(b" ", 2)
        return (
            int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None
        )

    def json(self) -> dict:
        return json.loads(self.data.partition(b"\r\n\r\n")[2])


def raw_exchange(port: int, data: bytes, timeout: float = 30.0) -> RawReply:
    """Send `data` in one write, then read until the server closes the connection (`timeout`: the
    test's own bound on each socket call)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        try:
            conn.sendall(data)
            while chunk := conn.recv(65536):
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            return RawReply(received, True)
    return RawReply(received, False)


def request_head(method: str, path: str, headers: dict[str, str], version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
