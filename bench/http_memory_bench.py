"""Memory of both daemons under many slow readers of large answers, with and without their cap on large answers.

    python -m bench.http_memory_bench

The real agent (simulator, sampling every 0.1 s until its ring holds several MB) on 127.0.0.1 gets
--agent-readers connections that each ask for the whole ring (`/snapshots`) and then read nothing; the real
server gets --server-readers connections that each ask for the Swagger UI bundle (`/docs/assets/...`, 1.5 MB)
and read nothing. Readers are held for --hold seconds, then closed. Each process's RSS is read from /proc
before, every 50 ms during and 3 s after; its peak is the largest reading (and VmHWM). "Without the cap" runs
with --web.max-large-answers set far above the reader count. Connection limits are raised above the reader
count in both runs (and the agent's --web.max-requests, its worker threads) so that only the cap on large
answers is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from bench.server_live_bench import _free_port, proc_rss_bytes
from bench.restart_memory_bench import vm_hwm_bytes

UNCAPPED = 65_536  # the flags' largest value
SWAGGER_BUNDLE = "/docs/assets/swagger-ui-bundle.js"


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `url` answers (any status), or fail when the process ends or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} ended with {proc.returncode} before it answered")
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")


def _slow_readers(port: int, path: str, count: int) -> list[socket.socket]:
    """`count` connections that each send one GET and then read nothing (a receive buffer of 4 KiB)."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: identity\r\n\r\n".encode()
    out = []
    for _ in range(count):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(request)
        out.append(s)
    return out


def _statuses(readers: list[socket.socket]) -> dict[str, int]:
    """How many readers got each status (read from the first bytes each one has been sent)."""
    counts: dict[str, int] = {}
    for s in readers:
        s.settimeout(0.5)
        try:
            head = s.recv(64)
        except OSError:
            head = b""
        status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "closed"
        counts[status] = counts.get(status, 0) + 1
    return counts


def _measure(pid: int, open_readers: Callable[[], list[socket.socket]], hold: float) -> dict[str, Any]:
    """RSS before, peak while the readers are held (sampled every 50 ms), and 3 s after they close."""
    before = proc_rss_bytes(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc_rss_bytes(pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    readers = open_readers()
    time.sleep(hold)
    statuses = _statuses(readers)
    for s in readers:
        s.close()
    time.sleep(3)
    done.set()
    sampler.join()
    mb = 2**20
    return {
        "rss_before_mb": round(before / mb),
        "rss_peak_mb": round(peak[0] / mb),
        "rss_after_mb": round(proc_rss_bytes(pid) / mb),
        "vm_hwm_mb": round(vm_hwm_bytes(pid) / mb),
        "statuses": statuses,
    }


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_agent(cap: int, readers: int, fill: float, hold: float, work: Path) -> dict[str, Any]:
    """The simulated agent with a ring filled for `fill` seconds at 10 Hz, then `readers` slow /snapshots."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.agent.cli",
        "--simulate",
        "hgx-h100",
        "--sample.interval",
        "0.1",
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--web.max-large-answers",
        str(cap),
        "--web.max-connections",
        str(readers + 64),
        "--web.max-connections-per-address",
        str(readers + 64),
        "--web.max-requests",
        str(readers + 16),
        "--log.level",
        "warning",
    ]
    with open(work / f"agent-{cap}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    try:
        _wait_ready(f"http://127.0.0.1:{port}/healthz", proc, 60)
        time.sleep(fill)
        row = _measure(proc.pid, lambda: _slow_readers(port, "/snapshots", readers), hold)
        ring = httpx.get(f"http://127.0.0.1:{port}/snapshots", timeout=30)
        row["ring_mb"] = round(len(ring.content) / 2**20, 1)
    finally:
        _stop(proc)
    return {"daemon": "agent", "cap": cap, "readers": readers, **row}


def run_server(cap: int, readers: int, hold: float, work: Path) -> dict[str, Any]:
    """The server (one target, down) with `readers` slow readers of the Swagger UI bundle."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.server.cli",
        "serve",
        "--targets",
        f"127.0.0.1:{_free_port()}",
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--storage.path",
        str(work / f"server-{cap}.db"),
        "--web.max-large-answers",
        str(cap),
        "--web.max-connections",
        str(readers + 1024),
        "--web.max-requests",
        str(readers + 2048),
        "--log.level",
        "warning",
    ]
    with open(work / f"server-{cap}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    try:
        _wait_ready(f"http://127.0.0.1:{port}/healthz", proc, 60)
        httpx.get(f"http://127.0.0.1:{port}{SWAGGER_BUNDLE}", timeout=30)  # first-use costs, before "before"
        time.sleep(1)
        row = _measure(proc.pid, lambda: _slow_readers(port, SWAGGER_BUNDLE, readers), hold)
    finally:
        _stop(proc)
    return {"daemon": "server", "cap": cap, "readers": readers, **row}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table docs/benchmarks.md shows."""
    lines = [
        "| daemon | slow readers | --web.max-large-answers | RSS before MB | peak RSS MB | RSS after MB | answers (status: count) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        what = f"{r['readers']} × " + ("/snapshots" + f" ({r['ring_mb']} MB)" if r["daemon"] == "agent" else "bundle")
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        cap = "unbounded" if r["cap"] >= UNCAPPED else str(r["cap"])
        lines.append(
            f"| {r['daemon']} | {what} | {cap} | {r['rss_before_mb']} | {r['rss_peak_mb']} | {r['rss_after_mb']} "
            f"| {statuses} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """One JSON line per run, then the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.http_memory_bench")
    parser.add_argument("--agent-readers", type=int, default=32)
    parser.add_argument("--server-readers", type=int, default=1100)
    parser.add_argument("--agent-cap", type=int, default=4, help="the agent's --web.max-large-answers (default 4)")
    parser.add_argument("--server-cap", type=int, default=32, help="the server's --web.max-large-answers (default 32)")
    parser.add_argument("--fill", type=float, default=90.0, help="seconds the agent samples at 10 Hz first (90)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds the readers are held (default 10)")
    parser.add_argument("--only", choices=("agent", "server"), help="run one daemon only")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpufleet-httpmem-") as tmp:
        work = Path(tmp)
        if args.only != "server":
            for cap in (args.agent_cap, UNCAPPED):
                rows.append(run_agent(cap, args.agent_readers, args.fill, args.hold, work))
                print(json.dumps(rows[-1]), flush=True)
        if args.only != "agent":
            for cap in (args.server_cap, UNCAPPED):
                rows.append(run_server(cap, args.server_readers, args.hold, work))
                print(json.dumps(rows[-1]), flush=True)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
