"""Live server benchmark: N fake agents on N loopback ports, the real server pulling them every 5 s.

    python -m bench.server_live_bench --agents 500 1000 --duration 180 --server-cpus 0,1

One helper process (asyncio) serves every fake agent's `/snapshots?since=` with canned but
time-advancing snapshot-contract payloads (8 GPUs, one snapshot per second, cumulative energy
counters that grow). The server is the real `gpufleet-server serve` in its own process, pinned to
the given CPUs, discovering the agents through a file_sd file. We sample the server's CPU time and
RSS from /proc and its own /metrics (pull cycle duration, engine tick, samples ingested, overruns).

    python -m bench.server_live_bench --ingest prometheus --agents 250 500 --server-cpus 0,1

reads the agents through a real Prometheus instead (`--ingest.prometheus-url`): the fake agents also
answer `/metrics` with the agent's own exposition (its renderer, every series of an 8-GPU H100 node,
energy and activity counters advancing), a `prometheus` binary on PATH scrapes them every interval
through the same file_sd file, and its CPU and RSS are reported beside the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import httpx
import orjson

from gpufleet.agent.exposition import Renderer, render_age
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot

GPUS_PER_NODE = 8
RETENTION_SECONDS = 300
_ENERGY_MARK = 987654321.5


def gpu_sample(node: str, index: int) -> GpuSample:
    """The fake node's GPU, its energy counter at a marker value."""
    return GpuSample(
        index=index,
        uuid=f"GPU-{node}-{index:02d}",
        model="NVIDIA H100 80GB HBM3",
        hpc_job=f"job-{hash(node) % 97}",
        pci_bus_id=f"00000000:{index + 16:02X}:00.0",
        utilization_ratio=1.0,
        memory_utilization_ratio=0.4,
        sm_active_ratio=0.78 + index * 0.002,
        sm_occupancy_ratio=0.45,
        memory_used_bytes=60 * 2**30,
        memory_total_bytes=80 * 2**30,
        temperature_celsius=64.0 + index,
        memory_temperature_celsius=70.0,
        slowdown_temperature_celsius=87.0,
        shutdown_temperature_celsius=92.0,
        power_watts=610.0 + index,
        power_limit_watts=700.0,
        energy_joules_total=_ENERGY_MARK,
        sm_clock_hertz=1.98e9,
        sm_clock_max_hertz=1.98e9,
        memory_clock_hertz=2.6e9,
        memory_clock_max_hertz=2.6e9,
        throttle_reasons=0,
        throttle_seconds_total={"sw_power_cap": 12.0, "hw_slowdown": 0.0},
        nvlink_tx_bytes_total=10**12,
        nvlink_rx_bytes_total=10**12,
        pcie_tx_bytes_total=10**10,
        pcie_rx_bytes_total=10**10,
        ecc_corrected_errors_total=0,
        ecc_uncorrected_errors_total=0,
        xid_errors_total=0,
    )


def gpu_template(node: str, index: int) -> tuple[bytes, bytes]:
    """The GPU's JSON split around its energy counter, which is the one value that advances."""
    raw = orjson.dumps(gpu_sample(node, index).to_dict())
    before, _, after = raw.partition(orjson.dumps(_ENERGY_MARK))
    return before, after


class FakeAgent:
    """One node's canned snapshots: a sample every second since the helper started."""

    def __init__(self, node: str, t0: float) -> None:
        self.node = node
        self.t0 = t0
        self.gpus = [gpu_template(node, i) for i in range(GPUS_PER_NODE)]
        head = NodeSnapshot(
            node=node, time=0.0, gpus=(), driver_version="550.54.15", sample_duration_seconds=0.004
        ).to_dict()
        del head["gpus"], head["time"]
        self.head = orjson.dumps(head)[:-1]
        self._samples = [gpu_sample(node, i) for i in range(GPUS_PER_NODE)]
        self._exposition: tuple[NodeSnapshot, bytes] | None = None
        self._renderer = Renderer()

    def snapshot(self, t: float) -> bytes:
        """One snapshot at time t."""
        energy = 1e6 + (t - self.t0) * 610.0
        gpus = b",".join(b + repr(energy + i).encode() + a for i, (b, a) in enumerate(self.gpus))
        return self.head + b',"time":' + repr(t).encode() + b',"gpus":[' + gpus + b"]}"

    def answer(self, since: float | None) -> bytes:
        """The /snapshots body for a `since`."""
        now = int(time.time())
        first = max(int(self.t0), now - RETENTION_SECONDS)
        if since is not None:
            first = max(first, int(since) + 1)
        snaps = b",".join(self.snapshot(float(t)) for t in range(first, now + 1))
        return b'{"schema":1,"node":"' + self.node.encode() + b'","snapshots":[' + snaps + b"]}"

    def metrics(self) -> bytes:
        """The /metrics body as the agent renders it: the newest whole-second sample, re-rendered once per
        new sample (as the agent does), plus the per-scrape sample age."""
        now = time.time()
        t = float(int(now))
        if self._exposition is None or self._exposition[0].time != t:
            elapsed = t - self.t0
            gpus = tuple(replace(g, energy_joules_total=1e6 + elapsed * 610.0 + g.index) for g in self._samples)
            snap = NodeSnapshot(
                node=self.node, time=t, gpus=gpus, driver_version="550.54.15", sample_duration_seconds=0.004
            )
            activity = {
                g.uuid: {
                    "utilization": (elapsed * g.utilization_ratio, elapsed),
                    "sm_active": (elapsed * g.sm_active_ratio, elapsed),
                }
                for g in gpus
            }
            health = AgentHealth(node=self.node, version="bench", nvml_up=True, cycles_total=int(elapsed))
            self._exposition = (snap, self._renderer.render(snap, health, activity))
        snap, body = self._exposition
        return body + render_age(now, snap, self.node)


async def respond(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: Callable[[str], tuple[bytes, bytes]]
) -> None:
    """A tiny keep-alive HTTP/1.1 responder: answer(request target) gives the body and its content type."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            body, kind = answer(head.split(b" ", 2)[1].decode())
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: "
                + kind
                + b"\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_agent(agent: FakeAgent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """GET /metrics and GET /snapshots?since= of one fake agent."""

    def answer(target: str) -> tuple[bytes, bytes]:
        if target.startswith("/metrics"):
            return agent.metrics(), b"text/plain; version=0.0.4"
        since = float(target.split("since=", 1)[1].split("&", 1)[0]) if "since=" in target else None
        return agent.answer(since), b"application/json"

    await respond(reader, writer, answer)


async def run_fake_agents(count: int, sd_file: Path) -> None:
    """Listen on `count` loopback ports, write their file_sd, serve until killed."""
    t0 = time.time()
    addresses = []
    for i in range(count):
        agent = FakeAgent(f"bench-{i:04d}", t0)
        server = await asyncio.start_server(lambda r, w, a=agent: serve_agent(a, r, w), "127.0.0.1", 0, backlog=64)
        addresses.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    tmp = sd_file.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": addresses, "labels": {"bench": "live"}}]))
    tmp.rename(sd_file)
    await asyncio.Event().wait()


def proc_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_bytes(pid: int) -> int:
    """Resident set size of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """The unlabelled (or summed) server gauges and counters we report."""
    wanted = (
        "gpufleet_server_pull_cycle_duration_seconds",
        "gpufleet_server_engine_tick_duration_seconds",
        "gpufleet_server_samples_ingested_total",
        "gpufleet_server_cycle_overruns_total",
        "gpufleet_server_cycles_total",
        "gpufleet_server_target_up",
        "gpufleet_server_pull_errors_total",
    )
    out: dict[str, float] = {}
    for line in client.get(url).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_for_file(path: Path, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for the helper to publish its targets."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("fake agents did not start")
        time.sleep(0.2)


def run_one(
    count: int,
    duration: float,
    interval: float,
    server_cpus: set[int] | None,
    helper_cpus: set[int] | None,
    engine_yaml: str,
    ingest: str = "direct",
    history: float = 0.0,
) -> dict[str, Any]:
    """Start N fake agents and a server (pulling them, or reading them from a Prometheus that scrapes
    them), measure for `duration` seconds after a warm-up."""
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-"))
    sd_file = work / "agents.json"
    helper = subprocess.Popen(
        [sys.executable, "-m", "bench.server_live_bench", "--fake-agents", str(count), "--sd-file", str(sd_file)]
    )
    if helper_cpus:
        os.sched_setaffinity(helper.pid, helper_cpus)
    server = prometheus = None
    try:
        wait_for_file(sd_file, helper, 120)
        port = _free_port()
        config = work / "server.yaml"
        if ingest == "prometheus":
            prometheus, prom_url = start_prometheus(work, sd_file, interval)
            if helper_cpus:
                os.sched_setaffinity(prometheus.pid, helper_cpus)
            time.sleep(history)  # what Prometheus holds when the server starts: its first query asks for it
            source = f"ingest.prometheus-url: {prom_url}\n"
        else:
            source = f"targets.file-sd: {sd_file}\n"
        config.write_text(
            f"{source}web.listen-address: 127.0.0.1:{port}\n"
            f"pull.interval: {interval}\nstorage.path: {work / 'alerts.db'}\nlog.level: warning\n"
            f"{engine_yaml}"
        )
        server = subprocess.Popen([sys.executable, "-m", "gpufleet.server.cli", "serve", "--config.file", str(config)])
        if server_cpus:
            os.sched_setaffinity(server.pid, server_cpus)
        row = measure(server, helper, f"http://127.0.0.1:{port}/metrics", count, duration, interval, prometheus)
        return {"ingest": ingest, "history_s": history, **row}
    finally:
        for p in (server, prometheus, helper):
            if p is not None:
                p.terminate()
                p.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def start_prometheus(work: Path, sd_file: Path, interval: float) -> tuple[subprocess.Popen[bytes], str]:
    """A real Prometheus scraping the fake agents listed in sd_file every interval; waits until ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("--ingest prometheus needs a prometheus binary on PATH (apt-get install prometheus)")
    port = _free_port()
    config = work / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: {interval:g}s, scrape_timeout: {interval:g}s}}\n"
        "scrape_configs:\n"
        "  - job_name: gpufleet-agent\n"
        f"    file_sd_configs: [{{files: ['{sd_file}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("prometheus did not become ready")


def measure(
    server: subprocess.Popen[bytes],
    helper: subprocess.Popen[bytes],
    url: str,
    count: int,
    duration: float,
    interval: float,
    prometheus: subprocess.Popen[bytes] | None = None,
) -> dict[str, Any]:
    """Warm up for 3 pulls, then sample CPU, RSS and the server's metrics every pull interval."""
    warmup = 3 * interval + 5
    time.sleep(warmup)
    cycles, ticks, rss = [], [], []
    with httpx.Client(timeout=10) as client:
        first = scrape(client, url)
        cpu0, helper0, t0 = proc_cpu_seconds(server.pid), proc_cpu_seconds(helper.pid), time.monotonic()
        prom0 = proc_cpu_seconds(prometheus.pid) if prometheus else 0.0
        prom_rss = []
        while time.monotonic() - t0 < duration:
            time.sleep(interval)
            m = scrape(client, url)
            cycles.append(m.get("gpufleet_server_pull_cycle_duration_seconds", float("nan")))
            ticks.append(m.get("gpufleet_server_engine_tick_duration_seconds", float("nan")))
            rss.append(proc_rss_bytes(server.pid))
            if prometheus:
                prom_rss.append(proc_rss_bytes(prometheus.pid))
        cpu1, helper1, t1 = proc_cpu_seconds(server.pid), proc_cpu_seconds(helper.pid), time.monotonic()
        prom1 = proc_cpu_seconds(prometheus.pid) if prometheus else 0.0
        last = scrape(client, url)
    elapsed = t1 - t0
    ingested = last.get("gpufleet_server_samples_ingested_total", 0) - first.get(
        "gpufleet_server_samples_ingested_total", 0
    )
    return {
        "agents": count,
        "gpus": count * GPUS_PER_NODE,
        "seconds": round(elapsed),
        "cpu_percent": round(100 * (cpu1 - cpu0) / elapsed, 1),
        "helper_cpu_percent": round(100 * (helper1 - helper0) / elapsed, 1),
        "rss_mb_max": round(max(rss) / 2**20),
        "rss_mb_last": round(rss[-1] / 2**20),
        "pull_cycle_s_median": round(statistics.median(cycles), 3),
        "pull_cycle_s_max": round(max(cycles), 3),
        "engine_tick_s_median": round(statistics.median(ticks), 3),
        "engine_tick_s_max": round(max(ticks), 3),
        # Pulled, an agent's every 1 s sample arrives; through Prometheus, the one each scrape carried.
        "snapshots_per_s": round(ingested / elapsed, 1),
        "expected_snapshots_per_s": count if prometheus is None else round(count / interval, 1),
        "targets_up": int(last.get("gpufleet_server_target_up", 0)),
        "overruns": int(
            last.get("gpufleet_server_cycle_overruns_total", 0) - first.get("gpufleet_server_cycle_overruns_total", 0)
        ),
        "pull_errors": int(last.get("gpufleet_server_pull_errors_total", 0)),
        **(
            {
                "prometheus_cpu_percent": round(100 * (prom1 - prom0) / elapsed, 1),
                "prometheus_rss_mb_max": round(max(prom_rss) / 2**20),
            }
            if prometheus
            else {}
        ),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus(text: str | None) -> set[int] | None:
    return {int(c) for c in text.split(",")} if text else None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for each agent count and print a JSON line and a markdown row per run."""
    parser = argparse.ArgumentParser(prog="python -m bench.server_live_bench")
    parser.add_argument("--agents", type=int, nargs="+", default=[500, 1000])
    parser.add_argument("--duration", type=float, default=180.0, help="measured seconds per run (after warm-up)")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--server-cpus", default=None, help="pin the server to these CPUs, e.g. 0,1")
    parser.add_argument("--helper-cpus", default=None, help="pin the fake agents to these CPUs")
    parser.add_argument(
        "--ingest",
        choices=("direct", "prometheus"),
        default="direct",
        help="pull the agents (direct) or read them through a real Prometheus scraping them",
    )
    parser.add_argument(
        "--prometheus-history",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="let Prometheus scrape this long before the server starts (its first query's range)",
    )
    parser.add_argument(
        "--engine", default="", help="engine settings as YAML flow mapping, e.g. '{window_seconds: 600}'"
    )
    parser.add_argument("--fake-agents", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sd-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fake_agents:
        asyncio.run(run_fake_agents(args.fake_agents, args.sd_file))
        return 0
    engine_yaml = f"engine: {args.engine}\n" if args.engine else ""
    rows = []
    for count in args.agents:
        row = run_one(
            count,
            args.duration,
            args.interval,
            _cpus(args.server_cpus),
            _cpus(args.helper_cpus),
            engine_yaml,
            args.ingest,
            args.prometheus_history,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "\n| agents | GPUs | server CPU % | RSS max MB | pull cycle s (median / max) | engine tick s (median / max) "
        "| snapshots/s (expected) | targets up | overruns |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['agents']} | {r['gpus']} | {r['cpu_percent']} | {r['rss_mb_max']} | "
            f"{r['pull_cycle_s_median']} / {r['pull_cycle_s_max']} | {r['engine_tick_s_median']} / "
            f"{r['engine_tick_s_max']} | {r['snapshots_per_s']} ({r['expected_snapshots_per_s']}) | "
            f"{r['targets_up']} | {r['overruns']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
