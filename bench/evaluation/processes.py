"""A real process (a database, an agent, a server) for a benchmark or an evaluation run, stopped cleanly."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx


@contextlib.contextmanager
def running(
    cmd: list[str], ready_url: str, log: Path, timeout: float = 60.0, client: dict | None = None
) -> Iterator[subprocess.Popen]:
    """A process, once `ready_url` answers 200 (`client`: httpx options, for one behind a web config);
    stopped with SIGTERM (then killed) on the way out. Its stderr goes to `log`, whose tail the error names
    when it never gets ready."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
        try:
            wait_ready(proc, ready_url, log, timeout, client)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float, client: dict | None = None) -> None:
    """Until `url` answers 200; RuntimeError with the log's tail when the process ends or never answers."""
    waiter = threading.Event()
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2, **(client or {})).status_code == 200:
                return
        waiter.wait(0.05)
    raise RuntimeError(f"{proc.args!r} did not start: {log.read_text(errors='replace')[-2000:]}")
