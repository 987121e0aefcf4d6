"""A response that never finishes, for the tests of bounded image fetches: each byte arrives well
within any read timeout, the whole never does."""

from __future__ import annotations

import http.server
import time


def trickle(handler: http.server.BaseHTTPRequestHandler, num_bytes: int) -> None:
    """Answer 200 announcing 100,000 bytes, then send `num_bytes` of them one every 0.1 s (stops when
    the client hangs up)."""
    handler.send_response(200)
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    for _ in range(num_bytes):
        try:
            handler.wfile.write(b"\0")
            handler.wfile.flush()
        except OSError:
            return
        time.sleep(0.1)
