"""One page per cause, end to end: the live pipeline (a real engine over a trace in which a hot GPU makes
itself a straggler and another GPU has XID 79 with ECC errors) notifies a real Alertmanager loaded with
the shipped deploy/alertmanager/alertmanager.yml, which must leave one alert un-inhibited per incident;
REST and the status page show the effects under their causes."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import orjson
from fastapi.testclient import TestClient

from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.store import SnapshotStore
from gpufleet.server.api import create_app
from gpufleet.server.contract import NodeSample, parse_line
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import build_engine
from gpufleet.server.settings import ServerSettings
from gpufleet.server.store import AlertStore
from tests.agent.fakes import FakeClock
from tests.agent.running import alertmanager_process, requires_alertmanager
from tests.server.engine_samples import MAX_HZ, T0, cluster_lines
from tests.server.test_source_protocol import ListSource

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "alertmanager" / "alertmanager.yml"
STEP_SECONDS = 5.0


def _incidents(t: float, node: str, gpu: int) -> dict:
    """From 400 s n0 GPU 5 runs hot, its clocks cut (thermal_throttle, and the straggler that makes); n1 GPU 6
    counts XID 79 and uncorrected ECC errors."""
    if t < 400:
        return {}
    if (node, gpu) == ("n0", 5):
        return {
            "temperature_celsius": 90.0,
            "throttle_reasons": 0x40,
            "sm_clock_hertz": 0.7 * MAX_HZ,
            "sm_active_ratio": 0.8,
            "power_watts": 420.0,
        }
    if (node, gpu) == ("n1", 6):
        k = int((t - 400) // 20)
        return {
            "xid_errors_total": k,
            "xid_errors_by_code": {79: k},
            "ecc_uncorrected_errors_total": k,
            "sm_active_ratio": 0.6,
            "power_watts": 410.0,
        }
    return {"sm_active_ratio": 0.6, "power_watts": 410.0}


def _batches(seconds: float) -> list[list[NodeSample]]:
    """The trace in one batch per pull, each ending before the pull's clock."""
    samples = sorted((parse_line(line) for line in cluster_lines(seconds, override=_incidents)), key=lambda s: s.time)
    batches: list[list[NodeSample]] = [[] for _ in range(int(seconds / STEP_SECONDS) + 1)]
    for s in samples:
        batches[int((s.time - T0) // STEP_SECONDS)].append(s)
    return batches


def _scenario_batches(name: str, seconds: int) -> list[list[NodeSample]]:
    """A simulator scenario, its nodes sampled each second by the agent's own sampler, in one batch per pull."""
    spec = load_scenario(name)
    clock = FakeClock(T0)
    samplers = [
        Sampler(
            NvmlReader(SimNvml(spec, node=node, clock=clock.time, epoch=T0, block_on_events=True)),
            SnapshotStore(),
            node=node,
            clock=clock.time,
        )
        for node in spec.nodes
    ]
    batches: list[list[NodeSample]] = []
    try:
        for k in range(seconds):
            if k % int(STEP_SECONDS) == 0:
                batches.append([])
            for sampler in samplers:
                snap = sampler.run_once()
                if snap is not None:
                    batches[-1].append(parse_line(orjson.dumps(snap.to_dict())))
            clock.advance(1.0)
    finally:
        for sampler in samplers:
            sampler.stop()
    return batches


def _run(
    tmp_path: Path, am_url: str, batches: list[list[NodeSample]]
) -> tuple[Runtime, AlertmanagerNotifier, ServerSettings]:
    """The live pipeline over the batches, notifying Alertmanager once at the end (every state it queued)."""
    settings = ServerSettings(storage_path=str(tmp_path / "alerts.db"), pull_interval_seconds=STEP_SECONDS)
    now = [T0]
    source = ListSource(batches, clock=lambda: now[0], stale_after_seconds=60.0)
    notifier = AlertmanagerNotifier(am_url, external_url="http://gpufleet:9472")
    runtime = Runtime(
        engine=build_engine(settings),
        source=source,
        store=AlertStore(settings.storage_path),
        notifiers=[notifier],
        pull_interval_seconds=STEP_SECONDS,
        clock=lambda: now[0],
    )

    async def drive() -> None:
        for k in range(len(source.batches)):
            now[0] = T0 + STEP_SECONDS * (k + 1)
            await runtime.cycle()
        assert await notifier.step()

    asyncio.run(drive())
    return runtime, notifier, settings


def _pages(groups: list[dict]) -> tuple[dict[str, list[tuple]], dict[str, list[str]]]:
    """What each incident pages (its un-inhibited alerts' kind, node, GPU) and the kinds it mutes."""
    by_incident: dict[str, list[dict]] = {}
    for g in groups:
        assert set(g["labels"]) == {"incident"}  # the shipped route groups gpufleet's alerts by incident
        by_incident.setdefault(g["labels"]["incident"], []).extend(g["alerts"])
    for alerts in by_incident.values():
        for a in alerts:
            if a["status"]["state"] == "suppressed":
                assert a["labels"]["role"] == "effect" and a["status"]["inhibitedBy"], a
    paged = {
        incident: [
            (a["labels"]["kind"], a["labels"]["node"], a["labels"].get("gpu"))
            for a in alerts
            if a["status"]["state"] == "active"
        ]
        for incident, alerts in by_incident.items()
    }
    muted = {
        incident: sorted(a["labels"]["kind"] for a in alerts if a["status"]["state"] == "suppressed")
        for incident, alerts in by_incident.items()
    }
    return paged, muted


def _settled_groups(url: str) -> list[dict]:
    """Alertmanager's alert groups once its inhibitor has seen every cause: it takes them in on its own
    goroutine, so the first answers may show an effect not yet muted."""
    waiter = threading.Event()
    groups: list[dict] = []
    for _ in range(100):
        groups = httpx.get(f"{url}/api/v2/alerts/groups", timeout=10).json()
        alerts = [a for g in groups for a in g["alerts"]]
        if alerts and all(a["status"]["state"] == "suppressed" for a in alerts if a["labels"]["role"] == "effect"):
            break
        waiter.wait(0.1)
    return groups


@requires_alertmanager
def test_each_cause_pages_once_with_the_shipped_config_and_its_effects_show_under_it(tmp_path) -> None:
    with alertmanager_process(tmp_path, config_text=SHIPPED.read_text()) as (_, port, log_path):
        url = f"http://127.0.0.1:{port}"
        runtime, notifier, settings = _run(tmp_path, url, _batches(700.0))
        groups = _settled_groups(url)
    assert notifier.failed_total == 0, log_path.read_text(errors="replace")[-2000:]
    paged, muted = _pages(groups)
    assert all(len(p) == 1 for p in paged.values()), paged  # one page per incident
    heat = next(i for i, p in paged.items() if p == [("thermal_throttle", "n0", "5")])
    xid = next(i for i, p in paged.items() if p == [("xid", "n1", "6")])
    assert muted[heat] == ["straggler"] and muted[xid] == ["ecc"], muted

    client = TestClient(create_app(settings, runtime=runtime, run_pipeline=False))
    listed = {i["id"]: i for i in client.get("/incidents").json()["incidents"]}
    assert (listed[heat]["cause"]["kind"], [e["kind"] for e in listed[heat]["effects"]]) == (
        "thermal_throttle",
        ["straggler"],
    )
    assert [e["kind"] for e in listed[xid]["effects"]] == ["ecc"]
    stored = client.get("/alerts", params={"incident": xid}).json()["alerts"]
    assert sorted((a["kind"], a["role"]) for a in stored) == [("ecc", "effect"), ("xid", "cause")]

    page = client.get("/").text
    page = page[page.index("<h2>Firing alerts") :]  # the jobs table above links the straggler too
    cause_row = page.index(f'/ui/alerts/{heat}"')
    effect_row = page.index(f'/ui/alerts/{listed[heat]["effects"][0]["id"]}"')
    assert cause_row < effect_row and page.count("<tr class=effect>") == 2
    assert page[effect_row - 400 : effect_row].count("<tr class=effect>") == 1  # the straggler's row is an effect's
    effect_page = client.get(f"/ui/alerts/{listed[heat]['effects'][0]['id']}").text
    assert f'effect of <a href="/ui/alerts/{heat}">' in effect_page
    runtime.store.close()


def _paged_through_alertmanager(
    tmp_path, scenario: str, seconds: int
) -> tuple[dict[str, list[tuple]], dict[tuple, list[str]]]:
    """The scenario's first `seconds` run live against a real Alertmanager with the shipped config: its
    pages by incident, and each page's alert -> the kinds muted under it. Every send went through, and each
    incident paged once."""
    batches = _scenario_batches(scenario, seconds)
    with alertmanager_process(tmp_path, config_text=SHIPPED.read_text()) as (_, port, log_path):
        url = f"http://127.0.0.1:{port}"
        runtime, notifier, _ = _run(tmp_path, url, batches)
        groups = _settled_groups(url)
    runtime.store.close()
    assert notifier.failed_total == 0, log_path.read_text(errors="replace")[-2000:]
    paged, muted = _pages(groups)
    assert all(len(p) == 1 for p in paged.values()), paged  # one page per incident
    return paged, {p[0]: muted[i] for i, p in paged.items()}


@requires_alertmanager
def test_each_root_cause_of_the_cluster_incidents_scenario_pages_once(tmp_path) -> None:
    # node-a GPU 6 counts ECC errors from +110 s and XID 79 from +120 s; node-a GPU 1's cooling fails from +100 s
    # (and it falls behind its peers); node-b GPU 3 is power-braked. Until after the heat's straggler fires.
    paged, by_page = _paged_through_alertmanager(tmp_path, "cluster-incidents", 260)
    assert by_page[("thermal_throttle", "node-a", "1")] == ["straggler"]  # the straggler the heat makes
    assert by_page[("xid", "node-a", "6")] == ["ecc"]  # the ECC errors fired first, alone: regrouped since
    assert by_page[("straggler", "node-b", "3")] == []  # a power brake: a cause of its own
    assert len(paged) == len(by_page)  # no two incidents page the same alert


@requires_alertmanager
def test_the_demo_pages_its_cooling_failure_once(tmp_path) -> None:
    # dgx-02 GPU 5's cooling fails from +200 s and holds its job back: the heat and the straggler it makes.
    _, by_page = _paged_through_alertmanager(tmp_path, "demo", 350)
    assert by_page[("thermal_throttle", "dgx-02", "5")] == ["straggler"], by_page
