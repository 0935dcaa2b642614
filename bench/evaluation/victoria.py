"""A real single-node VictoriaMetrics on 127.0.0.1 for tests and benchmarks, and loading history into it.

`victoria_metrics()` runs the Debian package's binary (`victoria-metrics`) on a free loopback port with its
data in a temporary folder, optionally scraping with a Prometheus-style `-promscrape.config`. History is
loaded through `/api/v1/import/prometheus`, which takes exposition lines with timestamps: the scenario
traces' snapshots become the series a gpufleet agent exports (`exposition_lines`), stamped at their
sample time, so a replay of the database and a replay of the trace see the same samples.

VictoriaMetrics makes imported samples searchable a little after it acknowledges them, even after
`/internal/force_flush`: a query in the next tens of milliseconds (longer on a busy host) can answer
`success` with some or none of them, which a replay would take for nodes that went silent. So a load
returns only once the database counts every sample sent (`settle`).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import httpx
import orjson

from bench.evaluation.processes import running
from gpufleet.server.readings import READINGS, Kind

BINARY = shutil.which("victoria-metrics")
WHY_MISSING = "victoria-metrics not installed (apt-get install victoria-metrics)"
_READY_SECONDS = 30.0
_IMPORT_BATCH_LINES = 200_000
_SETTLE_SECONDS = 120.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def victoria_metrics(
    data: Path | None = None, scrape_config: Path | None = None, extra: Iterable[str] = ()
) -> Iterator[str]:
    """A running VictoriaMetrics (victoria_process); yields its base URL."""
    with victoria_process(data, scrape_config, extra) as (_, url):
        yield url


@contextlib.contextmanager
def victoria_process(
    data: Path | None = None, scrape_config: Path | None = None, extra: Iterable[str] = ()
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A running VictoriaMetrics; yields the process and its base URL. Retention is a century, so history of any age can be
    imported; search answers up to the present (no latency offset) and caches nothing, so a query after a
    flush sees every sample."""
    assert BINARY is not None, WHY_MISSING
    with contextlib.ExitStack() as stack:
        folder = data or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vm-")))
        port = free_port()
        cmd = [
            BINARY,
            f"-storageDataPath={folder / 'vm'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=ERROR",
            *([f"-promscrape.config={scrape_config}"] if scrape_config else []),
            *extra,
        ]
        url = f"http://127.0.0.1:{port}"
        with running(cmd, f"{url}/health", folder / "victoria-metrics.log", _READY_SECONDS) as proc:
            yield proc, url


def flush(url: str) -> None:
    """Make every sample ingested so far searchable now (VictoriaMetrics buffers the newest in memory)."""
    httpx.get(f"{url}/internal/force_flush", timeout=30.0).raise_for_status()


def import_lines(url: str, lines: Iterable[str], extra_labels: Mapping[str, str] | None = None) -> int:
    """Post exposition lines with millisecond timestamps; returns how many were sent, once the database
    answers queries with every one of them (settle; samples already stored in the range they span would
    end that wait early)."""
    params = [("extra_label", f"{k}={v}") for k, v in (extra_labels or {}).items()]
    sent = 0
    first_ms, last_ms = math.inf, -math.inf
    batch: list[str] = []
    with httpx.Client(timeout=120.0) as client:

        def post() -> None:
            client.post(
                f"{url}/api/v1/import/prometheus", params=params, content="\n".join(batch) + "\n"
            ).raise_for_status()

        for line in lines:
            batch.append(line)
            ms = int(line.rsplit(" ", 1)[1])
            first_ms, last_ms = min(first_ms, ms), max(last_ms, ms)
            if len(batch) >= _IMPORT_BATCH_LINES:
                post()
                sent += len(batch)
                batch = []
        if batch:
            post()
            sent += len(batch)
    if sent:
        settle(url, sent, first_ms / 1000, last_ms / 1000)
    return sent


def stored(url: str, first: float, last: float) -> int:
    """How many samples a query over [first, last] (unix seconds) finds, of every series."""
    window = math.ceil(last - first) + 1
    answer = httpx.get(
        f"{url}/api/v1/query",
        params={"query": f'sum(count_over_time({{__name__=~".+"}}[{window}s]))', "time": f"{last:.3f}"},
        timeout=120.0,
    )
    answer.raise_for_status()
    result = answer.json()["data"]["result"]
    return int(float(result[0]["value"][1])) if result else 0


def settle(url: str, samples: int, first: float, last: float, timeout: float = _SETTLE_SECONDS) -> None:
    """Flush, then wait until a query over [first, last] finds at least `samples` samples; RuntimeError
    saying how many it found when it never does."""
    waiter = threading.Event()
    end = time.monotonic() + timeout
    while True:
        flush(url)
        found = stored(url, first, last)
        if found >= samples:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"{url} answers {found} of the {samples} samples imported after {timeout:.0f} s")
        waiter.wait(0.05)


def _agent_series() -> list[tuple[str, str, str | None, str | None, bool]]:
    """(contract field, metric, label, label value, is a flag) for every reading an agent exports."""
    return [
        (r.name, r.agent.metric, r.agent.label, r.agent.value, r.kind is Kind.FLAG)
        for r in READINGS
        if r.agent is not None
    ]


_SERIES = _agent_series()


def _quoted(value: Any) -> str:
    return orjson.dumps(str(value)).decode()


def exposition_lines(snapshot: Mapping[str, Any], scrape_job: str = "gpufleet-agent") -> Iterator[str]:
    """A contract snapshot as the series an agent exports for it, stamped at its sample time: what the
    Prometheus source reads back into the same snapshot (its ratio gauges, not activity counters, which a
    recorded trace does not carry)."""
    node = str(snapshot["node"])
    ms = round(float(snapshot["time"]) * 1000)
    where = f"node={_quoted(node)},instance={_quoted(node + ':9471')},job={_quoted(scrape_job)}"
    yield f"gpufleet_agent_sample_age_seconds{{{where}}} 0 {ms}"
    for gpu in snapshot.get("gpus") or ():
        ids = f'{where},gpu="{int(gpu["index"])}",uuid={_quoted(gpu["uuid"])}'
        model = f",model={_quoted(gpu.get('model') or 'unknown')}"
        job = gpu.get("hpc_job")
        if job is not None:
            yield f"gpufleet_gpu_job_info{{{ids},hpc_job={_quoted(job)}}} 1 {ms}"
        for field, metric, label, value, is_flag in _SERIES:
            reading = gpu.get(field)
            if reading is None or field == "xid_errors_total":
                continue
            number = float(reading) if not is_flag else (1.0 if reading else 0.0)
            if not math.isfinite(number):
                continue
            told = f",{label}={_quoted(value)}" if label is not None else ""
            yield f"{metric}{{{ids}{model}{told}}} {number!r} {ms}"
        for code, count in (gpu.get("xid_errors_by_code") or {}).items():
            yield f"gpufleet_gpu_xid_errors_total{{{ids},xid={_quoted(code)}}} {float(count)!r} {ms}"


def import_trace(url: str, lines: Iterable[bytes]) -> int:
    """Every snapshot line of a trace into the database as an agent's series; returns the lines sent."""
    return import_lines(url, (row for line in lines for row in exposition_lines(orjson.loads(line))))
