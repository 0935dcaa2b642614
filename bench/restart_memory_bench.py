"""Server memory on a restart into a fleet whose agents hold full rings.

    python -m bench.restart_memory_bench --agents 50 100 250

N fake agents on N loopback ports (bench.server_live_bench's: 8 H100 GPUs, one snapshot a second), each
with a full 300 s ring when the server starts, and honouring `/snapshots?since=&span=` as gpufleet agents
do. The real `gpufleet-server serve` discovers them through a file_sd file; we read its peak RSS (VmHWM)
once its first two pull cycles are done, and its RSS then. `--first-span`/`--first-concurrency` set what a
first pull asks for (the engine's `min_history_seconds` and `--pull.first-concurrency`): `--first-span 300
--first-concurrency 256` asks every agent for its whole ring at once. Each run is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx

from bench.server_live_bench import RETENTION_SECONDS, FakeAgent, _free_port, proc_rss_bytes, respond, wait_for_file


class RingAgent(FakeAgent):
    """A fake agent that has been sampling for a whole ring already, and keeps to `span` too."""

    def __init__(self, node: str, t0: float) -> None:
        super().__init__(node, t0)
        self._ring: dict[int, bytes] = {}
        self.answer_query("")  # rendered before the server starts: the helper must not be what is slow

    def answer_query(self, query: str) -> bytes:
        params = parse_qs(query)
        now = int(time.time())
        first = now - RETENTION_SECONDS + 1
        if "since" in params:
            first = max(first, int(float(params["since"][-1])) + 1)
        if "span" in params:
            first = max(first, int(now - float(params["span"][-1])) + 1)
        for t in [t for t in self._ring if t <= now - RETENTION_SECONDS]:
            del self._ring[t]
        snaps = b",".join(
            self._ring.get(t) or self._ring.setdefault(t, self.snapshot(float(t))) for t in range(first, now + 1)
        )
        return (
            b'{"schema":1,"node":"'
            + self.node.encode()
            + b'","time":'
            + repr(time.time()).encode()
            + b',"snapshots":['
            + snaps
            + b"]}"
        )


async def serve_ring(agent: RingAgent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """GET /snapshots of one agent with a full ring."""
    await respond(reader, writer, lambda target: (agent.answer_query(target.partition("?")[2]), b"application/json"))


async def run_ring_agents(count: int, sd_file: Path) -> None:
    """Listen on `count` loopback ports, write their file_sd, serve until killed."""
    addresses = []
    for i in range(count):
        agent = RingAgent(f"bench-{i:04d}", time.time() - RETENTION_SECONDS)
        server = await asyncio.start_server(lambda r, w, a=agent: serve_ring(a, r, w), "127.0.0.1", 0, backlog=64)
        addresses.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    tmp = sd_file.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": addresses, "labels": {"bench": "restart"}}]))
    tmp.rename(sd_file)
    await asyncio.Event().wait()


def vm_hwm_bytes(pid: int) -> int:
    """Peak resident set size of a process so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(client: httpx.Client, url: str, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics (0 when absent or unreachable)."""
    try:
        text = client.get(url).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


def run_one(count: int, first_span: float, first_concurrency: int, timeout: float) -> dict[str, Any]:
    """Start N ring agents, then the server; peak RSS once two cycles are done."""
    work = Path(tempfile.mkdtemp(prefix="gpufleet-restart-"))
    sd_file = work / "agents.json"
    helper = subprocess.Popen(
        [sys.executable, "-m", "bench.restart_memory_bench", "--fake-agents", str(count), "--sd-file", str(sd_file)]
    )
    server = None
    try:
        wait_for_file(sd_file, helper, 120)
        port = _free_port()
        config = work / "server.yaml"
        config.write_text(
            f"targets.file-sd: {sd_file}\nweb.listen-address: 127.0.0.1:{port}\n"
            f"storage.path: {work / 'alerts.db'}\nlog.level: warning\n"
            f"pull.first-concurrency: {first_concurrency}\npull.concurrency: 256\n"
            f"engine: {{min_history_seconds: {first_span:g}}}\n"
        )
        started = time.monotonic()
        server = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.server.cli", "serve", "--config.file", str(config)],
            env={**os.environ, "MALLOC_ARENA_MAX": "2"},
        )
        url = f"http://127.0.0.1:{port}/metrics"
        with httpx.Client(timeout=10) as client:
            cycles = 0.0
            while cycles < 2 and time.monotonic() - started < timeout and server.poll() is None:
                time.sleep(0.5)
                cycles = metric(client, url, "gpufleet_server_cycles_total")
            ingested = metric(client, url, "gpufleet_server_samples_ingested_total")
            up = metric(client, url, "gpufleet_server_target_up")
        return {
            "agents": count,
            "first_span_s": first_span,
            "first_concurrency": first_concurrency,
            "cycles": int(cycles),
            "seconds_to_2_cycles": round(time.monotonic() - started, 1),
            "peak_rss_mb": round(vm_hwm_bytes(server.pid) / 2**20),
            "rss_mb": round(proc_rss_bytes(server.pid) / 2**20),
            "snapshots_ingested": int(ingested),
            "targets_up": int(up),
        }
    finally:
        for p in (server, helper):
            if p is not None:
                p.terminate()
                p.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """One JSON line and one markdown row per agent count."""
    parser = argparse.ArgumentParser(prog="python -m bench.restart_memory_bench")
    parser.add_argument("--agents", type=int, nargs="+", default=[50, 100, 250])
    parser.add_argument(
        "--first-span",
        type=float,
        default=120.0,
        help="seconds a first pull asks for (the engine's min_history_seconds; default 120)",
    )
    parser.add_argument("--first-concurrency", type=int, default=8, help="--pull.first-concurrency (default 8)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up on a run after this many seconds")
    parser.add_argument("--fake-agents", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sd-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fake_agents:
        asyncio.run(run_ring_agents(args.fake_agents, args.sd_file))
        return 0
    rows = []
    for count in args.agents:
        row = run_one(count, args.first_span, args.first_concurrency, args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "\n| agents | first pull: span s, concurrency | peak RSS MB | RSS after 2 cycles MB | seconds to 2 cycles "
        "| targets up |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['agents']} | {r['first_span_s']:g}, {r['first_concurrency']} | {r['peak_rss_mb']} | {r['rss_mb']} "
            f"| {r['seconds_to_2_cycles']} | {r['targets_up']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
