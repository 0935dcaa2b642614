"""A dcgm-exporter fleet and no gpufleet agent: a real Prometheus holding dcgm-exporter's stock series, and the
server's pipeline reading it (`--ingest.prometheus-url`) finds the hot GPU and the slow one, and no other.
The server reading the same Prometheus for series it does not hold says so within one cycle.

Fifteen minutes of scrapes are backfilled into Prometheus's TSDB (tests/dcgm_exposition.py) and the
pipeline runs at pinned times over them, a cycle per 15 s of history: nothing waits.
"""

from __future__ import annotations

import asyncio
import time

import httpx
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
HOT = ("node-d", 2)               # 89 C from 240 s to 540 s (five minutes)
SLOW = ("node-c", 1)              # from 360 s on: works full time while its job's other GPUs wait for it
CYCLE_SECONDS = 15.0
NO_HBM_SENSOR = ("node-a", 3)     # DCGM's blank for its memory temperature: unsupported, not a reading


def reading(t_rel: float, host: str, gpu: int) -> Gpu:
    temp = 64.0 + ripple(t_rel, host, gpu, 1.5)
    power = 650.0 + ripple(t_rel, host, gpu, 6.0)
    if (host, gpu) == HOT and 240.0 <= t_rel < 540.0:
        temp = 89.0
    if HOSTS[host] == "71001" and t_rel >= 360.0 and (host, gpu) != SLOW:
        power -= 110.0            # spinning in NCCL's collective, waiting: busy, less power
    return Gpu(temperature_celsius=temp, power_watts=power, hbm_sensor=(host, gpu) != NO_HBM_SENSOR)


@pytest.fixture(scope="module")
def dcgm_prometheus(tmp_path_factory):
    """A real Prometheus over 15 min of backfilled dcgm-exporter scrapes; yields (base URL, start time)."""
    if PROMTOOL is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("dcgm-prometheus")
    start = float(int(time.time()) - 3 * 3600)    # within retention, and before anything Prometheus scrapes
    fleet = Fleet(HOSTS, GPUS, lambda t, host, gpu: reading(t - start, host, gpu))
    backfill(PROMTOOL, record(fleet, start, HISTORY_SECONDS, SCRAPE_SECONDS), tmp / "tsdb")
    with prometheus_process(tmp, []) as (_, port, _):
        yield f"http://127.0.0.1:{port}", start


def pipeline(url: str, tmp_path, *flags: str):
    """The server's runtime reading `url` at a pinned clock, and a client of its API."""
    now = [0.0]
    settings = load_settings(["--ingest.prometheus-url", url, "--storage.path", str(tmp_path / "alerts.db"),
                              "--pull.interval", f"{CYCLE_SECONDS:.0f}s", *flags], env={})
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
                assert runtime.puller.blind is None, runtime.puller.blind
        finally:
            await runtime.stop()
        return fired

    fired = asyncio.run(cycles())

    assert runtime.puller.samples_total >= len(HOSTS) * HISTORY_SECONDS / SCRAPE_SECONDS
    assert {n["node"]: n["gpus"] for n in runtime.view.nodes} == {h: GPUS for h in HOSTS}
    assert runtime.puller.errors_by_reason() == {}        # the blank refused no snapshot
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
    assert straggler[0].evidence["slowdown_measured_by"] == "power"        # no SM activity in stock counters
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
    assert health.status_code == 200           # the server works; what it reads is missing (see server.md)
    body = health.json()
    assert (body["status"], body["degraded_reason"]) == ("degraded", "no_series")
    assert "gpufleet_gpu_" in body["degraded_detail"] and "found no series" in body["degraded_detail"]
    assert 'gpufleet_server_blind_cycles_total{reason="no_series"} 1.0' in client.get("/metrics").text
