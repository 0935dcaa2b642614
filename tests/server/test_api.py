"""The REST API: filters, pagination, bad parameters (4xx, never 500), 404s, schema, restart persistence."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from gpufleet.server.alerts import AlertKind, AlertState, Severity
from gpufleet.server.api import create_app
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.runtime import Runtime
from gpufleet.server.settings import ServerSettings
from gpufleet.server.store import AlertStore
from tests.server.live_fakes import StubEngine, envelope, make_alert, parse_dict, snapshot


def build(tmp_path, handler=None, engine=None) -> tuple[Runtime, TestClient]:
    settings = ServerSettings(storage_path=str(tmp_path / "api.db"))
    transport = httpx.MockTransport(handler or (lambda r: httpx.Response(200, content=b'{"schema":1,"snapshots":[]}')))
    puller = Puller(StaticTargets(("a:1",)), transport=transport, parse=parse_dict, clock=lambda: 5000.0)
    runtime = Runtime(
        engine=engine or StubEngine(), source=puller, store=AlertStore(settings.storage_path), clock=lambda: 5000.0
    )
    return runtime, TestClient(create_app(settings, runtime=runtime, run_pipeline=False))


@pytest.fixture
def seeded(tmp_path):
    runtime, client = build(tmp_path)
    runtime.store.upsert(
        [
            make_alert(1, kind=AlertKind.THERMAL_THROTTLE, severity=Severity.CRITICAL, node="dgx-03", gpu=5),
            make_alert(2, kind=AlertKind.STRAGGLER, node="dgx-03", gpu=5, hpc_job="7"),
            make_alert(3, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job="7", state=AlertState.RESOLVED),
            *[make_alert(10 + i, node="dgx-09", gpu=i % 8, hpc_job="8") for i in range(30)],
        ]
    )
    return client


def summaries(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [a["summary"] for a in response.json()["alerts"]]


def test_filters(seeded) -> None:
    assert summaries(seeded.get("/alerts", params={"kind": "thermal_throttle"})) == ["alert 1"]
    assert summaries(seeded.get("/alerts", params={"node": "dgx-03", "gpu": 5})) == ["alert 2", "alert 1"]
    assert summaries(seeded.get("/alerts", params={"hpc_job": "7", "state": "resolved"})) == ["alert 3"]
    assert summaries(seeded.get("/alerts", params={"severity": "critical"})) == ["alert 1"]
    assert summaries(seeded.get("/alerts", params={"since": 1053.5, "hpc_job": "7"})) == ["alert 2"]
    body = seeded.get("/alerts", params={"kind": "comm_bound"}).json()["alerts"][0]
    assert body["node"] is None and body["gpu"] is None and body["state"] == "resolved"
    assert body["evidence"] == {"n": 3, "peers_median": 0.5}


def test_an_alert_says_its_cause_and_the_schema_documents_it(tmp_path) -> None:
    runtime, client = build(tmp_path)
    braked = replace(
        make_alert(1), evidence={"pattern": "gpu_clocks_cut", "throttle_causes": ["hw_slowdown_or_power_brake"]}
    )
    runtime.store.upsert([braked])
    (body,) = client.get("/alerts").json()["alerts"]
    assert body["cause"] == "gpu_clocks_cut+hw_slowdown_or_power_brake"
    assert client.get(f"/alerts/{braked.id}").json()["cause"] == body["cause"]
    schema = client.get("/openapi.json").json()["components"]["schemas"]["AlertModel"]["properties"]["cause"]
    assert "fixed vocabulary" in schema["description"]


def test_a_kubernetes_job_filters_whether_the_client_escapes_its_slash_or_not(tmp_path) -> None:
    runtime, client = build(tmp_path)
    runtime.store.upsert(
        [
            make_alert(1, node="gpu-b", gpu=5, hpc_job="research/llama-70b"),
            make_alert(2, node="gpu-c", gpu=1, hpc_job="research"),
        ]
    )
    assert summaries(client.get("/alerts", params={"hpc_job": "research/llama-70b"})) == ["alert 1"]
    assert summaries(client.get("/alerts?hpc_job=research/llama-70b")) == ["alert 1"]


def test_pagination(seeded) -> None:
    first = seeded.get("/alerts", params={"limit": 20}).json()
    assert first["total"] == 33 and len(first["alerts"]) == 20 and first["next_offset"] == 20
    second = seeded.get("/alerts", params={"limit": 20, "offset": first["next_offset"]}).json()
    assert len(second["alerts"]) == 13 and second["next_offset"] is None
    ids = [a["id"] for a in first["alerts"] + second["alerts"]]
    assert len(set(ids)) == 33
    beyond = seeded.get("/alerts", params={"offset": 500}).json()
    assert beyond["alerts"] == [] and beyond["total"] == 33


@pytest.mark.parametrize(
    "params",
    [
        {"state": "burning"},
        {"kind": "STRAGGLER"},
        {"severity": "high"},
        {"gpu": "five"},
        {"gpu": -1},
        {"gpu": 10**30},
        {"since": "yesterday"},
        {"since": "nan"},
        {"since": "inf"},
        {"since": -5},
        {"limit": 0},
        {"limit": 100000},
        {"limit": "x"},
        {"offset": -1},
        {"node": ""},
        {"hpc_job": "x" * 1000},
    ],
)
def test_bad_parameters_are_422_with_a_reason(seeded, params) -> None:
    response = seeded.get("/alerts", params=params)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail and detail[0]["loc"][-1] in params


def test_single_alert_and_404(seeded) -> None:
    listed = seeded.get("/alerts", params={"kind": "thermal_throttle"}).json()["alerts"][0]
    assert seeded.get(f"/alerts/{listed['id']}").json() == listed
    missing = seeded.get("/alerts/does-not-exist")
    assert missing.status_code == 404 and "does-not-exist" in missing.json()["detail"]
    assert seeded.get("/alerts/%00%ff'; DROP TABLE alerts;--").status_code == 404
    assert seeded.get("/alerts").json()["total"] == 33


def test_openapi_documents_the_models(seeded) -> None:
    schema = seeded.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for model in ("AlertModel", "AlertPageModel", "JobsModel", "NodesModel", "TargetModel", "HealthModel"):
        assert model in components
    kind = components["AlertModel"]["properties"]["kind"]
    assert kind["type"] == "string" and "straggler" in kind["description"]
    params = {p["name"] for p in schema["paths"]["/alerts"]["get"]["parameters"]}
    assert params == {
        "state",
        "kind",
        "severity",
        "node",
        "gpu",
        "hpc_job",
        "incident",
        "since",
        "limit",
        "offset",
        "scope",
    }
    assert "404" in schema["paths"]["/alerts/{alert_id}"]["get"]["responses"]
    assert seeded.get("/docs").status_code == 200


def test_nodes_jobs_health_after_a_cycle(tmp_path) -> None:
    payload = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 4990.0, temps=(95.0, 60.0))]))
    runtime, client = build(tmp_path, handler=lambda r: httpx.Response(200, content=payload))
    assert client.get("/healthz").status_code == 503
    assert client.get("/healthz").json()["status"] == "starting"
    asyncio.run(runtime.cycle())
    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.json() == {
        "status": "ok",
        "targets": 1,
        "targets_up": 1,
        "cycles": 1,
        "last_tick": 5000.0,
        "open_alerts": 1,
        "degraded_reason": None,
        "degraded_detail": None,
        "targets_never_answered": [],
        "store_unsaved_changes": 0,
        "store_unsaved_age_seconds": None,
    }
    nodes = client.get("/nodes").json()
    assert [(n["node"], n["gpus"]) for n in nodes["nodes"]] == [("dgx-01", 2)]
    assert nodes["targets"][0]["target"] == "a:1" and nodes["targets"][0]["node"] == "dgx-01"
    jobs = client.get("/jobs").json()
    assert jobs["jobs"][0]["hpc_job"] == "j1" and jobs["jobs"][0]["gpus"] == 2 and jobs["evaluated_at"] == 5000.0
    assert (jobs["jobs"][0]["gpu_hours_lost"], jobs["jobs"][0]["gpu_hours_lost_by_kind"]) == (0.5, {"straggler": 0.5})
    firing = client.get("/alerts", params={"state": "firing"}).json()
    assert firing["total"] == 1 and firing["alerts"][0]["gpu"] == 0


def test_health_is_degraded_within_one_cycle_when_every_target_is_down(tmp_path) -> None:
    runtime, client = build(tmp_path, handler=lambda r: httpx.Response(503))
    asyncio.run(runtime.cycle())
    health = client.get("/healthz")
    # 200 all the same: a liveness probe restarting the server cannot bring the agents back.
    assert health.status_code == 200
    body = health.json()
    assert (body["status"], body["degraded_reason"], body["targets_up"]) == ("degraded", "all_targets_down", 0)
    assert "every pull failed" in body["degraded_detail"]
    metrics = client.get("/metrics").text
    assert 'gpufleet_server_blind_cycles_total{reason="all_targets_down"} 1.0' in metrics
    assert "gpufleet_server_blind 1.0" in metrics


def test_health_is_degraded_naming_a_target_that_never_answered(tmp_path) -> None:
    payload = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 4990.0)]))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dgx-O2":  # a typo: the name resolves nowhere
            raise httpx.ConnectError("Name or service not known", request=request)
        return httpx.Response(200, content=payload)

    settings = ServerSettings(storage_path=str(tmp_path / "api.db"))
    puller = Puller(
        StaticTargets(("a:1", "dgx-O2:9400")),
        transport=httpx.MockTransport(handler),
        parse=parse_dict,
        clock=lambda: 5000.0,
    )
    runtime = Runtime(engine=StubEngine(), source=puller, store=AlertStore(settings.storage_path), clock=lambda: 5000.0)
    client = TestClient(create_app(settings, runtime=runtime, run_pipeline=False))
    asyncio.run(runtime.cycle())
    health = client.get("/healthz")
    assert health.status_code == 200
    body = health.json()
    assert (body["status"], body["degraded_reason"]) == ("degraded", "targets_never_answered")
    assert body["targets_never_answered"] == ["dgx-O2:9400"]
    assert body["degraded_detail"].startswith("dgx-O2:9400: ")


def test_health_is_503_when_cycles_stop_completing(tmp_path) -> None:
    payload = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 4990.0)]))
    runtime, client = build(tmp_path, handler=lambda r: httpx.Response(200, content=payload))
    asyncio.run(runtime.cycle())
    assert client.get("/healthz").json()["status"] == "ok"
    runtime.clock = lambda: 5031.0
    health = client.get("/healthz")
    assert health.status_code == 503
    assert (health.json()["status"], health.json()["degraded_reason"]) == ("degraded", "stalled")


def test_restart_persistence(tmp_path) -> None:
    hot = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 4990.0, temps=(95.0, 60.0))]))
    runtime, client = build(tmp_path, handler=lambda r: httpx.Response(200, content=hot))
    asyncio.run(runtime.cycle())
    alert_id = client.get("/alerts").json()["alerts"][0]["id"]
    runtime.store.close()

    engine = StubEngine()
    runtime2, client2 = build(tmp_path, engine=engine)
    am = AlertmanagerNotifier("http://am:9093", transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    runtime2.notifiers = (am,)
    assert runtime2.restore() == 1
    assert list(am._firing) == [alert_id]  # Alertmanager keeps hearing about it after the restart
    assert [a.id for a in engine.restored] == [alert_id]
    again = client2.get(f"/alerts/{alert_id}")
    assert again.status_code == 200 and again.json()["state"] == "firing"
    assert client2.get("/healthz").json()["open_alerts"] == 1


def test_lifespan_runs_the_pipeline_and_stops_cleanly(tmp_path) -> None:
    payload = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 4990.0)]))
    settings = ServerSettings(storage_path=str(tmp_path / "l.db"))
    puller = Puller(
        StaticTargets(("a:1",)),
        transport=httpx.MockTransport(lambda r: httpx.Response(200, content=payload)),
        parse=parse_dict,
    )
    engine = StubEngine()
    runtime = Runtime(engine=engine, source=puller, store=AlertStore(settings.storage_path), pull_interval_seconds=3600)
    with TestClient(create_app(settings, runtime=runtime)) as client:
        assert runtime.wait_for_cycles(1, timeout=10)  # the first cycle runs as soon as the lifespan starts
        assert client.get("/healthz").json()["cycles"] == 1
    assert len(engine.samples) == 1
