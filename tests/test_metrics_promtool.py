"""`promtool check metrics` (lint included) on both daemons' /metrics in the middle of an incident, when
every family has series: the agent on the simulator's `cluster-incidents` node as its GPU overheats after
an XID and ECC errors, and the server with the real engine firing a straggler that costs its job time."""

from __future__ import annotations

import asyncio
import re
import subprocess
from urllib.parse import parse_qs

import httpx
import orjson
from prometheus_client import generate_latest

from gpufleet.agent.exposition import render_age
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.store import SnapshotStore
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.metrics import build_registry
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import build_engine, build_notifiers
from gpufleet.server.settings import load_settings
from gpufleet.server.store import AlertStore
from tests.agent.fakes import FakeClock
from tests.agent.running import PROMTOOL, requires_promtool
from tests.server.engine_samples import T0, cluster_lines

pytestmark = requires_promtool


def promtool_problems(body: bytes) -> str:
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)
    return "" if result.returncode == 0 else (result.stdout + result.stderr).decode() or "failed"


def families(body: bytes) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", body.decode(), re.M))


def test_promtool_flags_a_counter_in_hours() -> None:
    # Guards the guard: what the server's job counter was called before it was in base units.
    body = b"# HELP x_gpu_hours_lost_total h\n# TYPE x_gpu_hours_lost_total counter\nx_gpu_hours_lost_total 1\n"
    assert 'use base unit "seconds"' in promtool_problems(body)


def test_agent_metrics_pass_mid_incident() -> None:
    spec = load_scenario("cluster-incidents")
    clock = FakeClock()
    # From +100 s, scenario time: ECC errors at +110 s, XID 79 at +120 s, the cooling failure from +100 s.
    nvml = SimNvml(spec, node="node-a", clock=clock.time, epoch=clock.now - 100, block_on_events=True)
    store = SnapshotStore()
    sampler = Sampler(NvmlReader(nvml, per_link_nvlink=True), store, node="node-a", clock=clock.time)
    try:
        for _ in range(40):
            snap = sampler.run_once()
            clock.advance(1.0)
    finally:
        sampler.stop()
    assert snap is not None
    body = store.latest().metrics + render_age(clock.now, snap, snap.node)
    text = body.decode()
    # XID events arrive on the agent's own XID thread, at no fixed cycle: their counter family is there from
    # the start, the per-code one from the first event.
    assert "gpufleet_gpu_xid_events_total" in families(body)
    assert re.search(r'gpufleet_gpu_ecc_errors_total\{[^}]*gpu="6"[^}]*type="uncorrected"[^}]*\} [1-9]', text)
    assert re.search(r'gpufleet_gpu_throttle_active\{[^}]*gpu="1"[^}]*reason="\w+_thermal_slowdown"[^}]*\} 1', text)
    assert promtool_problems(body) == ""


def _hot_straggler(t: float, node: str, gpu: int) -> dict:
    """n1 GPU 3 overheats and holds job j1 back from +400 s."""
    if (node, gpu) == ("n1", 3) and t >= 400:
        return dict(temperature_celsius=86.0, throttle_reasons=0x40, sm_clock_hertz=1.4e9, sm_active_ratio=0.8)
    return dict(sm_active_ratio=0.6, power_watts=420.0) if t >= 400 else {}


class Agents:
    """Each node's `/snapshots?since=` answers from a recorded trace, up to the time now[0]."""

    def __init__(self, lines: list[bytes]) -> None:
        self.now = T0
        self.by_node: dict[str, list[dict]] = {}
        for line in lines:
            snap = orjson.loads(line)
            self.by_node.setdefault(snap["node"], []).append(snap)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        node = request.url.host
        since = float(parse_qs(request.url.query.decode()).get("since", ["0"])[0])
        snaps = [s for s in self.by_node[node] if since < s["time"] <= self.now]
        return httpx.Response(200, content=orjson.dumps({"schema": 1, "node": node, "snapshots": snaps}))


def test_server_metrics_pass_while_a_straggler_costs_its_job_time(tmp_path) -> None:
    agents = Agents(cluster_lines(700, override=_hot_straggler))
    settings = load_settings(["--targets", "n0:9471,n1:9471", "--alertmanager.url", "http://am:9093"], env={})
    puller = Puller(StaticTargets(settings.targets), transport=httpx.MockTransport(agents), clock=lambda: agents.now)
    alertmanager = httpx.MockTransport(lambda request: httpx.Response(200))
    runtime = Runtime(
        engine=build_engine(settings),
        source=puller,
        store=AlertStore(tmp_path / "alerts.db"),
        notifiers=build_notifiers(settings, transport=alertmanager),
        clock=lambda: agents.now,
    )

    async def run() -> None:
        while agents.now < T0 + 650:
            agents.now += 5.0
            await runtime.cycle()
        await runtime.stop()

    asyncio.run(run())
    body = generate_latest(build_registry(runtime))
    lost = re.search(rb'gpufleet_job_gpu_seconds_lost_total\{hpc_job="j1",kind="straggler"\} (\S+)', body)
    assert lost and float(lost.group(1)) > 0, body.decode()[-3000:]
    assert {"gpufleet_alert_active", "gpufleet_alerts", "gpufleet_job_gpus", "gpufleet_node_gpus"} <= families(body)
    assert promtool_problems(body) == ""
