"""A real HTTP server on 127.0.0.1 for tests that need an agent or peer on the wire."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler], port: int = 0) -> Iterator[int]:
    """`handler` served on 127.0.0.1:`port` (0: any free port) in a thread; yields the port it bound."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def answer_json(handler: BaseHTTPRequestHandler, body: bytes, headers: dict[str, str] | None = None) -> None:
    """A 200 with a JSON body, as an agent answers /snapshots."""
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)
