"""Real processes for end-to-end tests: a `gpufleet-agent` (finding the port it bound), a `gpufleet-server`,
and a Prometheus scraping them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import httpx
import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def agent_process(*args: str, timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen, int]]:
    """Run the agent on 127.0.0.1:0 with JSON logs (info level or lower: the start line carries the port)."""
    def port_of(line: bytes) -> int | None:
        with contextlib.suppress(ValueError):
            record = orjson.loads(line)
            if record.get("msg") == "agent started":
                return int(record["port"])
        return None

    cmd = [sys.executable, "-m", "agent.cli", "--web.listen-address", "127.0.0.1:0", "--log.format", "json", *args]
    with _started("agent", cmd, port_of, timeout) as (proc, port):
        yield proc, port


@contextlib.contextmanager
def server_process(tmp_path: Path, *args: str, timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen, int]]:
    """Run `gpufleet-server serve` on a free 127.0.0.1 port with its alert store in tmp_path; yields once
    it logged that it listens."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--web.listen-address", f"127.0.0.1:{port}",
           "--storage.path", str(tmp_path / "server.db"), "--log.level", "info", *args]
    with _started("server", cmd, lambda line: port if b"gpufleet-server listening" in line else None,
                  timeout) as started:
        yield started


@contextlib.contextmanager
def _started(what: str, cmd: list[str], ready_from: Callable[[bytes], int | None],
             timeout: float) -> Iterator[tuple[subprocess.Popen, int]]:
    """Start cmd, read its log until ready_from(line) gives the port; SIGTERM (then kill) on the way out."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found: list[int] = []
    ready = threading.Event()
    lines: list[bytes] = []

    def pump() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            port = ready_from(line)
            if port is not None and not found:
                found.append(port)
                ready.set()
        ready.set()  # the process ended before it started serving

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(timeout) or not found:
            raise AssertionError(f"{what} did not start: " + b"".join(lines).decode(errors="replace")[-2000:])
        yield proc, found[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PROMETHEUS = shutil.which("prometheus")
requires_prometheus = pytest.mark.skipif(PROMETHEUS is None,
                                         reason="prometheus binary not installed (apt-get install prometheus)")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus_process(tmp_path: Path, targets: list[int],
                       scrape: str = "") -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """A real Prometheus on 127.0.0.1 scraping the given local ports every second (`scrape`: more lines of
    the job's scrape config, indented as its keys); yields (process, port, log)."""
    assert PROMETHEUS is not None
    port = free_port()
    config = tmp_path / "prometheus.yml"
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in targets)
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpufleet-agent\n"
        f"    static_configs: [{{targets: [{listed}]}}]\n" + scrape
    )
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log_file,
        )
        try:
            _wait_ready(proc, port, log_path)
            yield proc, port, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, port: int, log_path: Path, timeout: float = 60.0) -> None:
    """Until Prometheus answers /-/ready with 200. It listens before it has opened its TSDB and answers
    503 "Service Unavailable" meanwhile; a query in that gap failed a test on a loaded CI machine."""
    waiter = threading.Event()
    for _ in range(int(timeout / 0.2)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200:
                return
        waiter.wait(0.2)
    raise AssertionError("Prometheus never became ready: " + log_path.read_text(errors="replace")[-2000:])
