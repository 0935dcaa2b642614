"""The pictures on the pages, through the app: a real pipeline (puller, engine, store) pulls agents serving a
straggler, and the alert page and the status page draw what its windows held."""

from __future__ import annotations

import asyncio
import re
from datetime import timezone

import pytest
from fastapi.testclient import TestClient

from gpufleet.server.alerts import AlertKind, AlertState
from gpufleet.server.api import create_app
from gpufleet.server.api.charts import RELATIVE_STEPS
from gpufleet.server.api.models import AlertPageModel, JobModel, JobsModel, NodesModel
from gpufleet.server.api.page import render_overview
from gpufleet.server.history import Charts, FleetCell, Series
from gpufleet.server.runtime import FleetView
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings
from tests.server.engine_samples import T0, cluster_lines, slow_gpu_from_400
from tests.server.live_fakes import StepClock, make_alert, recorded_agents
from tests.server.test_page import build

SECONDS = 560


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("charts")
    clock = StepClock(T0)
    settings = ServerSettings(
        targets=("n0:9471", "n1:9471"), pull_interval_seconds=5.0, storage_path=str(tmp / "server.db")
    )
    runtime = build_runtime(
        settings, clock=clock, transport=recorded_agents(cluster_lines(SECONDS, override=slow_gpu_from_400), clock)
    )

    async def pull() -> None:
        while clock.now < T0 + SECONDS:
            clock.now += 5.0
            await runtime.cycle()

    asyncio.run(pull())
    yield runtime, TestClient(create_app(settings, runtime=runtime, run_pipeline=False))
    runtime.store.close()


def _svgs(html: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", html, flags=re.S)


def test_the_straggler_page_draws_it_against_its_peers(client):
    runtime, http = client
    (alert,) = [a for a in runtime.view.alerts if a.kind is AlertKind.STRAGGLER and a.state is AlertState.FIRING]
    html = http.get(f"/ui/alerts/{alert.id}").text
    assert "Readings against its peers" in html and "its job&#x27;s other 15 GPUs" in html.replace("'", "&#x27;")
    sm, power = _svgs(html)
    assert "<title" in sm and "SM activity of n1 GPU 3 against its 15 peers" in sm
    assert "power of n1 GPU 3 against its 15 peers" in power and "power (W)" in power
    for chart in (sm, power):
        assert 'class="subject"' in chart and 'class="median"' in chart and 'class="band"' in chart
        assert ">pending</text>" in chart and ">firing</text>" in chart and 'class="legend"' in chart
    # The engine's own numbers, in words for a screen reader: the culprit computes, its peers wait.
    assert "Latest: n1 GPU 3 0.80 against median 0.62" in sm
    assert "Latest: n1 GPU 3 430 against median 410" in power


def test_the_status_page_draws_each_job_and_the_fleet(client):
    _, http = client
    html = http.get("/").text
    assert "GPUs now" in html and "One square per GPU, a row per node." in html
    svgs = _svgs(html)
    temperature, relative = (s for s in svgs if 'class="cell' in s)
    assert temperature.count('class="cell') == 16 == relative.count('class="cell')
    culprit = re.search(r'<rect [^>]*fill="([^"]+)"[^>]*><title>n1 GPU 3, job j1: 60 °C, SM activity 1\.29', relative)
    assert culprit and culprit.group(1) == RELATIVE_STEPS[-1][1] and 'class="cell out"' in culprit.group(0)
    (job,) = [s for s in svgs if "job j1: SM activity over the last hour" in s]
    assert 'class="median"' in job and 'class="band"' in job


def test_an_alert_the_engine_holds_no_readings_of_says_so(tmp_path):
    runtime, http = build(tmp_path)
    alert = make_alert(1, kind=AlertKind.XID)
    runtime.store.upsert([alert])
    runtime.view = FleetView(alerts=(alert,), evaluated_at=1100.0)
    html = http.get(f"/ui/alerts/{alert.id}").text
    assert "no data: the engine holds no readings of this subject now" in html and "<svg" not in html


def test_the_status_page_of_8000_gpus_stays_small():
    """1,000 nodes of 8 GPUs and 500 jobs: squares per node, a hundred jobs drawn."""
    times = tuple(T0 + 60.0 * i for i in range(60))
    hour = Series("sm_active_ratio", times, (), (0.61,) * 60, (0.55,) * 60, (0.7,) * 60)
    jobs = [f"{700000 + i}" for i in range(500)]
    charts = Charts(
        jobs={job: hour for job in jobs},
        fleet=tuple(FleetCell(f"node-{i:04d}", None, 8, jobs[i // 2], 60.0 + i % 30, 1.0) for i in range(1000)),
        fleet_per_node=True,
    )
    models = [JobModel.model_validate(_job(job)) for job in jobs]
    html = render_overview(
        NodesModel(nodes=[], targets=[], evaluated_at=T0),
        JobsModel(jobs=models, evaluated_at=T0),
        AlertPageModel(alerts=[], total=0, limit=100, offset=0, next_offset=None),
        AlertPageModel(alerts=[], total=0, limit=30, offset=0, next_offset=None),
        5,
        charts=charts,
        tz=timezone.utc,
    )
    assert "One square per node (8000 GPUs" in html and html.count('class="cell') == 2000
    assert html.count("SM activity over the last hour") == 100
    assert len(html.encode()) < 1_500_000, len(html.encode())


def _job(job: str) -> dict:
    return {
        "hpc_job": job,
        "gpus": 16,
        "nodes": ["node-0000"],
        "utilization_ratio": 0.9,
        "sm_active_ratio": 0.61,
        "baseline_sm_active_ratio": 0.8,
        "power_watts": 500.0,
        "estimated_slowdown_ratio": 0.0,
        "stragglers": [],
        "comm_bound": False,
        "input_bound": False,
        "comm_bound_share": 0.0,
        "evaluated_ticks": 300,
        "gpu_hours_lost": 0.0,
        "gpu_hours_lost_by_kind": {},
    }


def test_a_failing_picture_leaves_the_cycle_and_the_alerts_alone(tmp_path, monkeypatch):
    runtime, _ = build(tmp_path)
    calls = []

    def broken(engine, alerts):
        calls.append(engine)
        raise ValueError("a picture went wrong")

    monkeypatch.setattr(runtime.charts, "observe", broken)
    asyncio.run(runtime.cycle())
    assert calls and runtime.stats.cycles_total == 1 and runtime.stats.cycle_failures_total == 0
    assert runtime.view.charts == Charts() and runtime.view.evaluated_at is not None
