"""The server's /metrics collector: fresh families from the runtime's view and counters."""

from __future__ import annotations

import asyncio

import httpx
import orjson
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.server import __version__
from gpufleet.server.alerts import AlertState, Transition
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.metrics import build_registry
from gpufleet.server.runtime import FleetView, Runtime
from gpufleet.server.serve import build_notifiers
from gpufleet.server.settings import load_settings
from gpufleet.server.store import AlertStore
from tests.server.live_fakes import StubEngine, envelope, make_alert, parse_dict, snapshot


def samples(registry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def make_runtime(tmp_path, handler) -> Runtime:
    puller = Puller(
        StaticTargets(("a:1", "b:1")), transport=httpx.MockTransport(handler), parse=parse_dict, clock=lambda: 100.0
    )
    return Runtime(engine=StubEngine(), source=puller, store=AlertStore(tmp_path / "m.db"), clock=lambda: 100.0)


def test_alerts_jobs_and_ingest_series(tmp_path) -> None:
    payload = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 99.0, temps=(95.0, 50.0))]))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            return httpx.Response(200, content=b"garbage")
        return httpx.Response(200, content=payload)

    runtime = make_runtime(tmp_path, handler)
    asyncio.run(runtime.cycle())
    got = samples(build_registry(runtime))
    active = [k for k in got if k[0] == "gpufleet_alert_active"]
    assert len(active) == 1
    labels = dict(active[0][1])
    assert (labels["kind"], labels["node"], labels["gpu"], labels["hpc_job"]) == (
        "thermal_throttle",
        "dgx-01",
        "0",
        "j1",
    )
    assert labels["cause"] == ""  # the stub's evidence has no threshold to be over
    assert got[("gpufleet_alerts", (("kind", "thermal_throttle"), ("severity", "warning"), ("state", "firing")))] == 1
    assert got[("gpufleet_job_gpus", (("hpc_job", "j1"),))] == 2
    assert got[("gpufleet_job_comm_bound", (("hpc_job", "j1"),))] == 0
    assert got[("gpufleet_server_target_up", (("target", "a:1"),))] == 1
    assert got[("gpufleet_server_target_up", (("target", "b:1"),))] == 0
    # a:1's newest sample is 1 s older than the server's clock; b:1 never answered usefully: no offset, not 0.
    assert got[("gpufleet_server_target_clock_offset_seconds", (("target", "a:1"),))] == -1.0
    assert ("gpufleet_server_target_clock_offset_seconds", (("target", "b:1"),)) not in got
    assert got[("gpufleet_server_pull_errors_total", (("reason", "malformed_json"), ("target", "b:1")))] == 1
    (info,) = [dict(k[1]) for k in got if k[0] == "gpufleet_server_build_info"]
    assert info["version"] == __version__ and info["python"].startswith("3.")
    assert got[("gpufleet_server_rejected_total", (("reason", "malformed_json"),))] == 1
    assert got[("gpufleet_server_samples_ingested_total", ())] == 1
    assert got[("gpufleet_server_pulls_total", ())] == 2
    assert got[("gpufleet_server_cycles_total", ())] == 1
    assert got[("gpufleet_server_engine_last_tick_timestamp_seconds", ())] == 100.0
    assert ("gpufleet_server_engine_tick_duration_seconds", ()) in got
    assert not [k for k in got if k[0] == "gpufleet_server_engine_stat"]
    assert got[("gpufleet_node_gpus", (("node", "dgx-01"),))] == 2


def test_resolved_alerts_and_ended_jobs_disappear(tmp_path) -> None:
    runtime = make_runtime(tmp_path, lambda r: httpx.Response(200, content=b'{"schema":1,"snapshots":[]}'))
    registry = build_registry(runtime)
    runtime.view = FleetView(
        alerts=(make_alert(1), make_alert(2, state=AlertState.PENDING)),
        jobs=(
            {
                "hpc_job": "7",
                "gpus": 8,
                "estimated_slowdown_ratio": float("nan"),
                "stragglers": [{"node": "a", "gpu": 1}],
                "gpu_hours_lost_by_kind": {"straggler": 1.25, "comm_bound": 0.5},
            },
        ),
    )
    first = samples(registry)
    assert first[("gpufleet_job_gpu_seconds_lost_total", (("hpc_job", "7"), ("kind", "straggler")))] == 4500
    assert first[("gpufleet_job_gpu_seconds_lost_total", (("hpc_job", "7"), ("kind", "comm_bound")))] == 1800
    assert sum(1 for k in first if k[0] == "gpufleet_alert_active") == 1
    assert ("gpufleet_job_gpus", (("hpc_job", "7"),)) in first
    assert first[("gpufleet_job_stragglers", (("hpc_job", "7"),))] == 1  # a list of culprits counts as its length
    assert not any(k[0] == "gpufleet_job_slowdown_ratio" for k in first)  # NaN means unknown: no series
    runtime.view = FleetView()
    second = samples(registry)
    assert not any(
        k[0] in ("gpufleet_alert_active", "gpufleet_alerts", "gpufleet_job_gpus", "gpufleet_job_gpu_seconds_lost_total")
        for k in second
    )


def test_empty_runtime_exposes_no_unknown_values(tmp_path) -> None:
    runtime = make_runtime(tmp_path, lambda r: httpx.Response(200))
    got = samples(build_registry(runtime))
    assert ("gpufleet_server_engine_tick_duration_seconds", ()) not in got
    assert ("gpufleet_server_pull_cycle_duration_seconds", ()) not in got
    assert got[("gpufleet_server_cycles_total", ())] == 0


def test_every_alertmanager_replica_gets_every_alert_and_its_own_counters(tmp_path) -> None:
    """An HA Alertmanager pair: both are sent everything (they de-duplicate between themselves), and one being
    down neither holds back nor hides the other."""
    received: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "am-1":
            return httpx.Response(400)  # refused: not retried, counted
        received.append(orjson.loads(request.content)[0]["labels"]["alertname"])
        return httpx.Response(200)

    settings = load_settings(
        ["--alertmanager.url", "http://am-0:9093,http://am-1:9093/", "--webhook.url", "http://hooks/x"], env={}
    )
    notifiers = build_notifiers(settings, transport=httpx.MockTransport(handler))
    assert [n.url for n in notifiers] == [
        "http://am-0:9093/api/v2/alerts",
        "http://am-1:9093/api/v2/alerts",
        "http://hooks/x",
    ]

    async def deliver() -> None:
        for n in notifiers[:2]:
            n.submit([Transition(make_alert(1), None)])
            await n.step()
            await n.aclose()
        await notifiers[2].aclose()

    asyncio.run(deliver())
    assert received == ["GpufleetStraggler"]
    runtime = Runtime(
        engine=StubEngine(),
        source=Puller(StaticTargets(()), transport=httpx.MockTransport(handler)),
        store=AlertStore(tmp_path / "n.db"),
        notifiers=notifiers,
        clock=lambda: 100.0,
    )
    got = samples(build_registry(runtime))
    sent, failed = "gpufleet_server_notifications_sent_total", "gpufleet_server_notifications_failed_total"
    assert got[(sent, (("notifier", "alertmanager"), ("url", "http://am-0:9093/api/v2/alerts")))] == 1
    assert got[(failed, (("notifier", "alertmanager"), ("url", "http://am-1:9093/api/v2/alerts")))] == 1
    assert got[(sent, (("notifier", "alertmanager"), ("url", "http://am-1:9093/api/v2/alerts")))] == 0
    assert got[(sent, (("notifier", "webhook"), ("url", "http://hooks/x")))] == 0
    runtime.store.close()


def test_engine_statistics_are_typed_counters_gauges_and_a_timestamp(tmp_path) -> None:
    runtime = make_runtime(tmp_path, lambda r: httpx.Response(200, content=b'{"schema":1,"snapshots":[]}'))
    stats = dict(
        samples_ingested=40,
        late_samples_dropped=2,
        too_old_snapshots_dropped=1,
        pending_samples=3,
        ticks=7,
        last_tick_time=1795808310.0,
        gpus=16,
        nodes=2,
        jobs=1,
        open_alerts=2,
        firing_alerts=1,
    )
    runtime.view = FleetView(stats=stats)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(build_registry(runtime)).decode())}
    assert "gpufleet_server_engine_stat" not in families
    for name, value in (
        ("gpufleet_server_engine_samples_ingested", 40),
        ("gpufleet_server_engine_late_samples_dropped", 2),
        ("gpufleet_server_engine_ticks", 7),
    ):
        assert families[name].type == "counter"
        assert [s.value for s in families[name].samples if s.name == name + "_total"] == [value]
    for name, value in (
        ("gpufleet_server_engine_pending_samples", 3),
        ("gpufleet_server_engine_gpus", 16),
        ("gpufleet_server_engine_firing_alerts", 1),
        ("gpufleet_server_engine_last_evaluation_timestamp_seconds", 1795808310.0),
    ):
        assert families[name].type == "gauge" and [s.value for s in families[name].samples] == [value]
    assert families["gpufleet_server_samples_dropped"].samples[0].labels == {"reason": "too_old"}
