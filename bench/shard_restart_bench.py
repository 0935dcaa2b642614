"""How long a restarted shard takes to raise an incident that was already running, from the database's history.

    python -m bench.shard_restart_bench --repeats 3

Real processes on loopback: five simulated agents (SCENARIO: four jobs of one node each, a node of no job, a
cooling failure in job 81004 from the start), a real VictoriaMetrics scraping them every second
(`-search.latencyOffset=1s`), and two shards (`--shard 0/2`, `1/2`, 2 s cycles) reading it. Once the owning
shard's thermal_throttle alert fires, the shard is stopped and started again with an empty alert store (a pod
rescheduled without its volume: nothing to restore, everything from history), and the bench reads, from the
new process's start: when it answers HTTP, and when its /alerts first shows the incident firing (polled every
0.1 s), with its CPU time (user + system, from /proc) to then. One JSON line per restart.
tests/test_shards_victoriametrics.py runs the same fleet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.evaluation.processes import running
from gpufleet.server.shard import Shard

SCENARIO = """
name: shards
description: four jobs of one node each, a node of no job, a cooling failure in job 81004 from the start
duration_s: 7200
nodes:
  - {name: n1, model: h100-sxm, gpus: 2}
  - {name: n2, model: h100-sxm, gpus: 2}
  - {name: n3, model: h100-sxm, gpus: 2}
  - {name: n4, model: h100-sxm, gpus: 2}
  - {name: spare-a, model: h100-sxm, gpus: 2}
jobs:
  - {id: "81001", nodes: [n1], start_s: 0, step_time_s: 0.8, compute_fraction: 0.8}
  - {id: "81002", nodes: [n2], start_s: 0, step_time_s: 0.8, compute_fraction: 0.8}
  - {id: "81004", nodes: [n3], start_s: 0, step_time_s: 0.8, compute_fraction: 0.8}
  - {id: "81005", nodes: [n4], start_s: 0, step_time_s: 0.8, compute_fraction: 0.8}
incidents:
  - {kind: cooling_failure, node: n3, gpu: 1, start_s: 0, end_s: 7200, resistance_factor: 2.6}
"""
JOBS = {"81001": "n1", "81002": "n2", "81004": "n3", "81005": "n4"}  # job -> its node; both shards own some
JOBLESS = "spare-a"
HOT = ("n3", 1)  # node and GPU of the cooling failure, in job 81004
COUNT = 2


def owner_of_job(job: str, count: int = COUNT) -> int:
    return next(i for i in range(count) if Shard(i, count).owns_job(job))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """Agents, VictoriaMetrics and one restartable server per shard, under `tmp`."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.tmp = tmp
        scenario = tmp / "shards.yaml"
        scenario.write_text(SCENARIO)
        agents = []
        for node in [*JOBS.values(), JOBLESS]:
            port = free_port()
            agents.append(port)
            cmd = [sys.executable, "-m", "gpufleet.agent.cli", "--simulate", str(scenario), "--node", node]
            cmd += ["--web.listen-address", f"127.0.0.1:{port}"]
            stack.enter_context(running(cmd, f"http://127.0.0.1:{port}/metrics", tmp / f"agent-{node}.log"))
        self.victoria_port = free_port()
        config = tmp / "scrape.yml"
        listed = ", ".join(f"'127.0.0.1:{p}'" for p in agents)
        config.write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n  - job_name: gpufleet-agent\n"
            f"    static_configs: [{{targets: [{listed}]}}]\n"
        )
        victoria = shutil.which("victoria-metrics")
        if victoria is None:
            raise SystemExit("victoria-metrics not installed (apt-get install victoria-metrics)")
        cmd = [victoria, f"-promscrape.config={config}", f"-storageDataPath={tmp / 'victoria-data'}"]
        cmd += [f"-httpListenAddr=127.0.0.1:{self.victoria_port}", "-search.latencyOffset=1s", "-loggerLevel=WARN"]
        stack.enter_context(running(cmd, f"http://127.0.0.1:{self.victoria_port}/-/ready", tmp / "victoria.log"))
        self.ports = [free_port() for _ in range(COUNT)]
        self.servers: dict[int, tuple[contextlib.ExitStack, subprocess.Popen]] = {}
        stack.callback(lambda: [self.stop(i) for i in list(self.servers)])
        for index in range(COUNT):
            self.start(index, "first")

    def start(self, index: int, run: str) -> float:
        """Start shard `index` with a fresh alert store; returns when its process was started."""
        folder = self.tmp / f"shard{index}-{run}"
        folder.mkdir()
        cmd = [sys.executable, "-m", "gpufleet.server.cli", "serve", "--shard", f"{index}/{COUNT}"]
        cmd += ["--ingest.prometheus-url", f"http://127.0.0.1:{self.victoria_port}", "--pull.interval", "2s"]
        cmd += ["--pull.timeout", "2s", "--storage.path", str(folder / "server.db")]
        cmd += ["--web.listen-address", f"127.0.0.1:{self.ports[index]}"]
        started = time.time()
        stack = contextlib.ExitStack()
        url = f"http://127.0.0.1:{self.ports[index]}/metrics"
        self.servers[index] = (stack, stack.enter_context(running(cmd, url, folder / "server.log")))
        return started

    def stop(self, index: int) -> None:
        self.servers.pop(index)[0].close()

    def hot_alerts(self, index: int, **params: Any) -> list[dict]:
        answer = httpx.get(f"http://127.0.0.1:{self.ports[index]}/alerts", params=params, timeout=10).json()
        return [a for a in answer["alerts"] if (a["kind"], a["node"], a["gpu"]) == ("thermal_throttle", *HOT)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="most seconds to wait for an alert")
    args = parser.parse_args()
    owner = owner_of_job("81004")
    waiter = threading.Event()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        fleet = Fleet(Path(tmp), stack)

        def wait_firing() -> dict:
            end = time.monotonic() + args.timeout
            while time.monotonic() < end:
                with contextlib.suppress(httpx.TransportError):
                    if found := fleet.hot_alerts(owner, state="firing"):
                        return found[0]
                waiter.wait(0.1)
            raise SystemExit("the incident never fired")

        wait_firing()
        for run in range(args.repeats):
            fleet.stop(owner)
            started = fleet.start(owner, f"restart-{run}")
            listening = time.time()
            alert = wait_firing()
            fired = time.time()
            line = {
                "restart": run,
                "answering_s": round(listening - started, 2),
                "alert_firing_s": round(fired - started, 2),
                "cpu_s": round(cpu_seconds(fleet.servers[owner][1].pid), 2),
                "alert_pending_since_before_start_s": round(started - alert["pending_since"], 1),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
