"""How long a restarted shard takes to raise an incident that was already running, from the database's history.

    python -m bench.shard_restart_bench --repeats 3

The fleet of tests/test_shards_victoriametrics.py, as real processes on loopback: five simulated agents (four
jobs, one node of no job, a cooling failure in job 81004 from the start), a real VictoriaMetrics scraping them
every second, and two shards (`--shard 0/2`, `1/2`, 2 s cycles) reading it. Once the owning shard's
thermal_throttle alert fires, the shard is stopped and started again with an empty alert store (a pod
rescheduled without its volume: nothing to restore, everything from history), and the bench reads, from the
new process's start: when it listens, and when its /alerts first shows the incident firing (polled every
0.1 s). Its CPU time (user + system, from /proc) to that point is printed beside. One JSON line per restart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from tests.test_shards_victoriametrics import HOT, Fleet, owner_of_job, until


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    owner = owner_of_job("81004")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        fleet = Fleet(Path(tmp), stack)
        until("the incident firing before any restart", lambda: fleet.hot_alerts(owner, state="firing"), fleet.alive)
        waiter = threading.Event()
        for run in range(args.repeats):
            fleet.stop(owner)
            started = fleet.start(owner, f"restart-{run}")
            listening = time.time()
            pid = fleet.servers[owner][1].pid
            while not fleet.hot_alerts(owner, state="firing"):
                fleet.alive()
                waiter.wait(0.1)
            fired = time.time()
            (alert,) = fleet.hot_alerts(owner, state="firing")
            print(
                json.dumps(
                    {
                        "restart": run,
                        "listening_s": round(listening - started, 2),
                        "alert_firing_s": round(fired - started, 2),
                        "cpu_s": round(cpu_seconds(pid), 2),
                        "alert_pending_since_before_start_s": round(started - alert["pending_since"], 1),
                        "subject": list(HOT),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
