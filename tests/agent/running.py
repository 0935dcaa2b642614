"""Real processes for end-to-end tests: a `gpufleet-agent` (finding the port it bound), a `gpufleet-server`,
a Prometheus scraping them, an Alertmanager."""

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

import orjson
import pytest

from bench.evaluation.processes import running

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def agent_process(*args: str, timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen, int]]:
    """Run the agent on 127.0.0.1:0 with JSON logs (info level or lower: the start line carries the port)."""
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.agent.cli",
        "--web.listen-address",
        "127.0.0.1:0",
        "--log.format",
        "json",
        *args,
    ]
    with _started("agent", cmd, _logged_port("agent started", lambda r: r["port"]), timeout) as (proc, port):
        yield proc, port


@contextlib.contextmanager
def server_process(tmp_path: Path, *args: str, timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen, int]]:
    """Run `gpufleet-server serve` on 127.0.0.1:0 with its alert store in tmp_path; yields once it logged
    that it listens, with the port it was given."""
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.server.cli",
        "serve",
        "--web.listen-address",
        "127.0.0.1:0",
        "--storage.path",
        str(tmp_path / "server.db"),
        "--log.level",
        "info",
        "--log.format",
        "json",
        *args,
    ]
    port_of = _logged_port("gpufleet-server listening", lambda r: r["address"].rpartition(":")[2])
    with _started("server", cmd, port_of, timeout) as started:
        yield started


def _logged_port(msg: str, port: Callable[[dict], object]) -> Callable[[bytes], int | None]:
    """Reads the port, with `port`, from the JSON log record whose message is `msg`."""

    def port_of(line: bytes) -> int | None:
        with contextlib.suppress(ValueError):
            record = orjson.loads(line)
            if record.get("msg") == msg:
                return int(port(record))
        return None

    return port_of


@contextlib.contextmanager
def _started(
    what: str, cmd: list[str], ready_from: Callable[[bytes], int | None], timeout: float
) -> Iterator[tuple[subprocess.Popen, int]]:
    """Start cmd, read its log until ready_from(line) gives the port; SIGTERM (then kill) on the way out."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
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
requires_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus binary not installed (apt-get install prometheus)"
)
PROMTOOL = shutil.which("promtool")
requires_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus_process(
    tmp_path: Path,
    targets: list[int],
    scrape: str = "",
    *,
    web_config: Path | None = None,
    client: dict | None = None,
    servers: list[int] | None = None,
    rule_files: list[Path] | None = None,
) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """A real Prometheus on 127.0.0.1 scraping the given local ports every second as job gpufleet-agent
    (`scrape`: more lines of that job's scrape config, indented as its keys), `servers` as job
    gpufleet-server, and evaluating `rule_files` every second (`web_config`: serve HTTPS behind that
    exporter-toolkit file, which `client`'s httpx options get past); yields (process, port, log)."""
    assert PROMETHEUS is not None
    port = free_port()
    config = tmp_path / "prometheus.yml"

    def listed(ports: list[int]) -> str:
        return ", ".join(f"'127.0.0.1:{p}'" for p in ports)

    text = (
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpufleet-agent\n"
        f"    static_configs: [{{targets: [{listed(targets)}]}}]\n" + scrape
    )
    if servers:
        text += f"  - job_name: gpufleet-server\n    static_configs: [{{targets: [{listed(servers)}]}}]\n"
    if rule_files:
        text += "rule_files: [" + ", ".join(f"'{path}'" for path in rule_files) + "]\n"
    config.write_text(text)
    cmd = [
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    if web_config is not None:
        cmd.append(f"--web.config.file={web_config}")
    with _daemon(cmd, port, tmp_path / "prometheus.log", "https" if web_config else "http", client) as (
        proc,
        log_path,
    ):
        yield proc, port, log_path


@contextlib.contextmanager
def _daemon(
    cmd: list[str], port: int, log_path: Path, scheme: str, client: dict | None
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """Run a Prometheus-family binary logging to log_path until it answers /-/ready with 200; stop it on
    the way out. Prometheus listens before it has opened its TSDB and answers 503 meanwhile; a query in
    that gap failed a test on a loaded CI machine."""
    with running(cmd, f"{scheme}://127.0.0.1:{port}/-/ready", log_path, client=client) as proc:
        yield proc, log_path


ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
requires_alertmanager = pytest.mark.skipif(
    ALERTMANAGER is None, reason="alertmanager binary not installed (apt-get install prometheus-alertmanager)"
)


@contextlib.contextmanager
def alertmanager_process(
    tmp_path: Path, web_config: Path | None = None, client: dict | None = None, config_text: str | None = None
) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """A real Alertmanager on 127.0.0.1, routing everything nowhere (or as `config_text` says), without
    clustering; behind `web_config` (HTTPS) when given, `client` holding the httpx options that get past it.
    Yields (process, port, log)."""
    assert ALERTMANAGER is not None
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text(config_text or "route: {receiver: nowhere}\nreceivers: [{name: nowhere}]\n")
    cmd = [
        ALERTMANAGER,
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
    ]
    if web_config is not None:
        cmd.append(f"--web.config.file={web_config}")
    with _daemon(cmd, port, tmp_path / "alertmanager.log", "https" if web_config else "http", client) as (
        proc,
        log_path,
    ):
        yield proc, port, log_path


VICTORIA_METRICS = shutil.which("victoria-metrics")
requires_victoria_metrics = pytest.mark.skipif(
    VICTORIA_METRICS is None, reason="victoria-metrics binary not installed (apt-get install victoria-metrics)"
)


@contextlib.contextmanager
def victoria_metrics_process(tmp_path: Path, targets: list[int]) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """A real single-node VictoriaMetrics on 127.0.0.1 scraping the given local ports every second as job
    gpufleet-agent, answering the Prometheus query API; yields (process, port, log). Its query latency offset
    (default 30 s: the newest points stay hidden that long) is 1 s, as a site serving gpufleet would set it."""
    assert VICTORIA_METRICS is not None
    port = free_port()
    config = tmp_path / "victoria-scrape.yml"
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in targets)
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpufleet-agent\n"
        f"    static_configs: [{{targets: [{listed}]}}]\n"
    )
    cmd = [
        VICTORIA_METRICS,
        f"-promscrape.config={config}",
        f"-storageDataPath={tmp_path / 'victoria-data'}",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-search.latencyOffset=1s",
        "-loggerLevel=WARN",
    ]
    with _daemon(cmd, port, tmp_path / "victoria-metrics.log", "http", None) as (proc, log_path):
        yield proc, port, log_path
