"""A real server killed mid-incident and started again on the same store keeps the engine's alert (a module
of its own: it waits on real processes for about a minute, and the test runner spreads modules over cores)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Callable

import httpx
import pytest

from tests.agent.running import agent_process, server_process


def test_a_real_server_killed_mid_incident_keeps_the_engines_thermal_alert(tmp_path) -> None:
    """Real processes: a simulated agent (the demo's dgx-02, whose GPU 5 loses its cooling from +200 s to
    +360 s) started at +230 s, and `serve` killed with SIGKILL once the engine's thermal_throttle fires.
    Started again on the same store, the server carries the alert on under its id and start, and sends no
    resolve while the GPU is still hot."""
    flags = ("--pull.interval", "1s", "--pull.timeout", "1s")
    epoch = time.time() - 230.0

    def thermal(api: httpx.Client) -> list[tuple[str, float, str]]:
        alerts = api.get("/alerts", params={"kind": "thermal_throttle"}).json()["alerts"]
        return [(a["id"], a["started"], a["state"]) for a in alerts if a["kind"] == "thermal_throttle"]

    def until(what: str, check: Callable[[], bool], proc: subprocess.Popen, seconds: float) -> None:
        waiter = threading.Event()
        for _ in range(int(seconds * 4)):
            assert proc.poll() is None, f"the server ended while waiting for: {what}"
            if check():
                return
            waiter.wait(0.25)
        pytest.fail(f"never within {seconds:g} s: {what}")

    with agent_process("--simulate", "demo", "--node", "dgx-02", "--simulate.epoch", repr(epoch)) as (_, agent_port):
        targets = ("--targets", f"127.0.0.1:{agent_port}")
        with server_process(tmp_path, *targets, *flags) as (proc, api_port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=10)
            until("thermal_throttle fires", lambda: any(s == "firing" for *_, s in thermal(api)), proc, 90)
            before = thermal(api)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert time.time() - epoch < 330, "the restart must fall inside the incident"
        with server_process(tmp_path, *targets, *flags) as (proc, api_port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=10)
            until("15 cycles after the restart", lambda: api.get("/healthz").json()["cycles"] >= 15, proc, 60)
            assert thermal(api) == before
