"""Start a real `gpufleet-agent` process for end-to-end tests and find the port it bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import orjson

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def agent_process(*args: str, timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen, int]]:
    """Run the agent on 127.0.0.1:0 with JSON logs (info level or lower: the start line carries the port)."""
    cmd = [sys.executable, "-m", "agent.cli", "--web.listen-address", "127.0.0.1:0", "--log.format", "json", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found: dict[str, int] = {}
    ready = threading.Event()
    lines: list[bytes] = []

    def pump() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            with contextlib.suppress(ValueError):
                record = orjson.loads(line)
                if record.get("msg") == "agent started":
                    found["port"] = int(record["port"])
                    ready.set()
        ready.set()  # the process ended before it started serving

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(timeout) or "port" not in found:
            raise AssertionError("agent did not start: " + b"".join(lines).decode(errors="replace")[-2000:])
        yield proc, found["port"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
