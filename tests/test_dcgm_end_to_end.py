"""A dcgm-exporter fleet and no gpufleet agent: a real Prometheus holding dcgm-exporter's stock series, and the
server's pipeline reading it (`--ingest.prometheus-url`) finds the hot GPU and the slow one, and no other.
The server reading the same Prometheus for series it does not hold says so within one cycle; where an
agent also reports some GPUs, those are read from the agent alone.

Fifteen minutes of scrapes are backfilled into Prometheus's TSDB (tests/dcgm_exposition.py) and the
pipeline runs at pinned times over them, a cycle per 15 s of history: nothing waits.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from gpufleet.server.api import create_app
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import load_settings
from tests.agent.running import PROMTOOL, prometheus_process, requires_prometheus, requires_promtool
from tests.dcgm_exposition import Fleet, Gpu, backfill, record, ripple, uuid

GPUS = 4
HOSTS = {"node-a": "71001", "node-b": "71001", "node-c": "71001", "node-d": "71002"}
SCRAPE_SECONDS = 10.0
HISTORY_SECONDS = 900.0
HOT = ("node-d", 2)  # 89 C from 240 s to 540 s (five minutes)
SLOW = ("node-c", 1)  # from 360 s on: works full time while its job's other GPUs wait for it
CYCLE_SECONDS = 15.0
NO_HBM_SENSOR = ("node-a", 3)  # DCGM's blank for its memory temperature: unsupported, not a reading


def reading(t_rel: float, host: str, gpu: int) -> Gpu:
    temp = 64.0 + ripple(t_rel, host, gpu, 1.5)
    power = 650.0 + ripple(t_rel, host, gpu, 6.0)
    if (host, gpu) == HOT and 240.0 <= t_rel < 540.0:
        temp = 89.0
    if HOSTS[host] == "71001" and t_rel >= 360.0 and (host, gpu) != SLOW:
        power -= 110.0  # spinning in NCCL's collective, waiting: busy, less power
    return Gpu(temperature_celsius=temp, power_watts=power, hbm_sensor=(host, gpu) != NO_HBM_SENSOR)


@pytest.fixture(scope="module")
def dcgm_prometheus(tmp_path_factory):
    """A real Prometheus over 15 min of backfilled dcgm-exporter scrapes; yields (base URL, start time)."""
    if PROMTOOL is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("dcgm-prometheus")
    start = float(int(time.time()) - 3 * 3600)  # within retention, and before anything Prometheus scrapes
    fleet = Fleet(HOSTS, GPUS, lambda t, host, gpu: reading(t - start, host, gpu))
    backfill(PROMTOOL, record(fleet, start, HISTORY_SECONDS, SCRAPE_SECONDS), tmp / "tsdb")
    with prometheus_process(tmp, []) as (_, port, _):
        yield f"http://127.0.0.1:{port}", start


def pipeline(url: str, tmp_path, *flags: str):
    """The server's runtime reading `url` at a pinned clock, and a client of its API."""
    now = [0.0]
    settings = load_settings(
        [
            "--ingest.prometheus-url",
            url,
            "--storage.path",
            str(tmp_path / "alerts.db"),
            "--pull.interval",
            f"{CYCLE_SECONDS:.0f}s",
            *flags,
        ],
        env={},
    )
    runtime = build_runtime(settings, clock=lambda: now[0])
    return runtime, now, TestClient(create_app(settings, runtime=runtime, run_pipeline=False))


@requires_prometheus
@requires_promtool
def test_the_server_finds_the_hot_and_the_slow_gpu_in_dcgm_exporter_data(dcgm_prometheus, tmp_path) -> None:
    url, start = dcgm_prometheus
    runtime, now, client = pipeline(url, tmp_path)

    async def cycles() -> dict[str, list]:
        fired: dict[str, list] = {}
        try:
            for k in range(int(HISTORY_SECONDS / CYCLE_SECONDS) + 1):
                now[0] = start + k * CYCLE_SECONDS + 1.0
                for t in await runtime.cycle():
                    fired.setdefault(t.alert.kind.value, []).append(t.alert)
                assert runtime.source.blind is None, runtime.source.blind
        finally:
            await runtime.stop()
        return fired

    fired = asyncio.run(cycles())

    assert runtime.source.samples_total >= len(HOSTS) * HISTORY_SECONDS / SCRAPE_SECONDS
    assert {n["node"]: n["gpus"] for n in runtime.view.nodes} == {h: GPUS for h in HOSTS}
    assert runtime.source.errors_by_reason() == {}  # the blank refused no snapshot
    subjects = {kind: {(a.node, a.gpu, a.hpc_job) for a in alerts} for kind, alerts in fired.items()}
    assert set(subjects) == {"thermal_throttle", "straggler"}, subjects
    assert subjects.get("thermal_throttle") == {(*HOT, "71002")}, subjects
    assert subjects.get("straggler") == {(*SLOW, "71001")}, subjects
    # Each fired once, soon after its incident began; the heat cleared after it ended.
    thermal = [a for a in fired["thermal_throttle"] if a.started is not None]
    assert len({a.id for a in thermal}) == 1 and thermal[0].evidence["temperature_celsius"] == 89.0
    assert start + 240.0 < thermal[0].started <= start + 300.0
    assert any(a.resolved is not None and a.resolved > start + 540.0 for a in fired["thermal_throttle"])
    straggler = [a for a in fired["straggler"] if a.started is not None]
    assert len({a.id for a in straggler}) == 1 and start + 360.0 < straggler[0].started <= start + 480.0
    assert straggler[0].evidence["slowdown_measured_by"] == "power"  # no SM activity in stock counters
    # What the stock counters lack is said, per detector.
    metrics = client.get("/metrics").text
    assert 'gpufleet_server_source_reading_missing{detector="thermal_throttle",' in metrics
    assert 'reading="throttle_reasons"' in metrics


@requires_prometheus
@requires_promtool
@pytest.mark.parametrize("flags", [("--ingest.prometheus-schema", "gpufleet"), ()], ids=["agents", "auto"])
def test_no_matching_series_is_degraded_within_one_cycle(dcgm_prometheus, tmp_path, flags) -> None:
    url, start = dcgm_prometheus
    # `auto` finds nothing an hour after the backfilled history; `gpufleet` finds no agent series in it.
    runtime, now, client = pipeline(url, tmp_path, *flags)
    now[0] = start + (HISTORY_SECONDS / 2 if flags else HISTORY_SECONDS + 3600.0)

    async def one() -> None:
        try:
            await runtime.cycle()
        finally:
            await runtime.stop()

    asyncio.run(one())

    health = client.get("/healthz")
    assert health.status_code == 200  # the server works; what it reads is missing (see server.md)
    body = health.json()
    assert (body["status"], body["degraded_reason"]) == ("degraded", "no_series")
    assert "gpufleet_gpu_" in body["degraded_detail"] and "found no series" in body["degraded_detail"]
    assert 'gpufleet_server_blind_cycles_total{reason="no_series"} 1.0' in client.get("/metrics").text


AGENT_NODE = "gpu-d"  # node-d also runs a gpufleet agent, which names it so


def agent_scrapes(start: float) -> list[tuple[float, str, str, str]]:
    """node-d's agent scraped beside its dcgm-exporter: the same GPUs (UUIDs), readings of its own kind (its
    slowdown temperature and max clock, which dcgm-exporter's stock counters lack)."""
    out = []
    energy = {g: 1.0e6 for g in range(GPUS)}
    for k in range(int(HISTORY_SECONDS / SCRAPE_SECONDS) + 1):
        at = start + k * SCRAPE_SECONDS + 0.5
        lines = []
        for g in range(GPUS):
            gpu = reading(at - start, "node-d", g)
            energy[g] += gpu.power_watts * SCRAPE_SECONDS
            ids = f'node="{AGENT_NODE}",gpu="{g}",uuid="{uuid("node-d", g)}"'
            with_model = ids + ',model="NVIDIA H100 80GB HBM3"'
            lines += [
                f"gpufleet_gpu_up{{{with_model}}} 1",
                f"gpufleet_gpu_temperature_celsius{{{with_model}}} {gpu.temperature_celsius}",
                f'gpufleet_gpu_temperature_limit_celsius{{{with_model},limit="slowdown"}} 87',
                f"gpufleet_gpu_power_watts{{{with_model}}} {gpu.power_watts}",
                f"gpufleet_gpu_energy_joules_total{{{with_model}}} {energy[g]}",
                f"gpufleet_gpu_utilization_ratio{{{with_model}}} {gpu.utilization_ratio}",
                f'gpufleet_gpu_clock_hertz{{{with_model},clock="sm"}} {gpu.sm_clock_hertz}',
                f'gpufleet_gpu_clock_max_hertz{{{with_model},clock="sm"}} 1.98e9',
                f"gpufleet_gpu_throttle_reasons{{{with_model}}} 0",
                f'gpufleet_gpu_job_info{{{ids},hpc_job="{HOSTS["node-d"]}"}} 1',
            ]
        lines.append(f'gpufleet_agent_sample_age_seconds{{node="{AGENT_NODE}"}} 0.2')
        out.append((at, f"{AGENT_NODE}:9471", "\n".join(lines) + "\n", "gpufleet-agent"))
    return out


@requires_prometheus
@requires_promtool
def test_a_gpu_with_an_agent_and_dcgm_exporter_in_one_prometheus_is_read_once_from_its_agent(tmp_path) -> None:
    start = float(int(time.time()) - 3 * 3600)
    fleet = Fleet(HOSTS, GPUS, lambda t, host, gpu: reading(t - start, host, gpu))
    backfill(PROMTOOL, record(fleet, start, HISTORY_SECONDS, SCRAPE_SECONDS) + agent_scrapes(start), tmp_path / "tsdb")
    with prometheus_process(tmp_path, []) as (_, port, _):
        runtime, now, _ = pipeline(f"http://127.0.0.1:{port}", tmp_path)

        async def cycles() -> list:
            fired = []
            try:
                for k in range(int(HISTORY_SECONDS / CYCLE_SECONDS) + 1):
                    now[0] = start + k * CYCLE_SECONDS + 1.0
                    fired += [t.alert for t in await runtime.cycle()]
            finally:
                await runtime.stop()
            return fired

        fired = asyncio.run(cycles())

    # node-d's GPUs are the agent's alone: no second node of the same UUIDs under dcgm-exporter's name.
    assert {n["node"]: n["gpus"] for n in runtime.view.nodes} == {
        "node-a": GPUS,
        "node-b": GPUS,
        "node-c": GPUS,
        AGENT_NODE: GPUS,
    }
    thermal = [a for a in fired if a.kind.value == "thermal_throttle" and a.started is not None]
    assert {(a.node, a.gpu) for a in thermal} == {(AGENT_NODE, HOT[1])}
    # From the agent's readings: its slowdown temperature (87 C, which dcgm-exporter does not export) makes
    # 89 C critical.
    assert thermal[-1].severity.value == "critical" and thermal[-1].evidence["slowdown_temperature_celsius"] == 87.0
    assert {(a.node, a.gpu) for a in fired if a.kind.value == "straggler" and a.started is not None} == {SLOW}
