"""A real `gpufleet-server serve` process on a free 127.0.0.1 port, for tests that need the whole program."""

from __future__ import annotations

import socket
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(port: int, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """The process and its "listening" log line, once it has logged it; killed on the way out if still up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--web.listen-address", f"127.0.0.1:{port}",
         "--log.level", "info", *args], stderr=subprocess.PIPE, text=True)
    try:
        line = next((line for line in proc.stderr if "gpufleet-server listening" in line), "")
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
