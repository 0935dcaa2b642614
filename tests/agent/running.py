"""Real processes for end-to-end tests: a `gpufleet-agent` (finding the port it bound), and a Prometheus scraping agents."""

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
from typing import Iterator

import orjson
import pytest

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


PROMETHEUS = shutil.which("prometheus")
requires_prometheus = pytest.mark.skipif(PROMETHEUS is None,
                                         reason="prometheus binary not installed (apt-get install prometheus)")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus_process(tmp_path: Path, targets: list[int]) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """A real Prometheus on 127.0.0.1 scraping the given local ports every second; yields (process, port, log)."""
    assert PROMETHEUS is not None
    port = free_port()
    config = tmp_path / "prometheus.yml"
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in targets)
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpufleet-agent\n"
        f"    static_configs: [{{targets: [{listed}]}}]\n"
    )
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log_file,
        )
        try:
            yield proc, port, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
