"""A sample source is one module: a toy one, written here, runs the live pipeline, /metrics, /healthz and /nodes
through the seam the shipped sources use (a SourceKind that settings.sample_sources() would list), with no
other code changed. CONTRIBUTING.md ("Add a source") walks the same steps."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Callable

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.server.api import create_app
from gpufleet.server.contract import NodeSample, parse_snapshot
from gpufleet.server.ingest.base import IngestAccounting, PullResult, SampleSource, SourceKind, TargetHealth, Wiring
from gpufleet.server.metrics import build_registry
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import build_engine, build_runtime, build_source, source_kind
from gpufleet.server.settings import ServerSettings, sample_sources
from gpufleet.server.store import AlertStore
from tests.server.live_fakes import envelope, job_gpu

NODES = ("dgx-01", "dgx-02")


class ListSource(IngestAccounting):
    """The whole of a toy source: one batch of NodeSamples from a list per cycle, a target per node seen."""

    def __init__(self, batches: list[list[NodeSample]], *, clock: Callable[[], float], stale_after_seconds: float):
        super().__init__()
        self.batches = batches
        self.stale_after_seconds = stale_after_seconds
        self._clock = clock
        self._health: dict[str, TargetHealth] = {}

    async def pull_once(self) -> PullResult:
        now = self._clock()
        self.pulls_total += 1
        batch = self.batches.pop(0) if self.batches else []
        for s in batch:
            h = self._health.get(s.node) or TargetHealth(target=f"list:{s.node}")
            newest = s.time if h.last_sample_time is None else max(h.last_sample_time, s.time)
            self._health[s.node] = replace(
                h, node=s.node, up=True, last_attempt=now, last_success=now, last_new_data=now, last_sample_time=newest
            )
        return self._finish_cycle(
            PullResult(
                samples=list(batch),
                started=now,
                duration_seconds=0.0,
                targets=len(self._health),
                failed_targets=0,
                rejected_snapshots=0,
            )
        )

    def health(self) -> list[TargetHealth]:
        return [self._health[n] for n in sorted(self._health)]

    async def aclose(self) -> None:
        self.batches = []


def list_kind(batches: list[list[NodeSample]]) -> SourceKind:
    """The toy's kind; a real source's `selected` reads its own setting (see sample_sources)."""

    def build(settings: ServerSettings, wiring: Wiring) -> SampleSource:
        return ListSource(batches, clock=wiring.clock, stale_after_seconds=settings.pull_stale_after_seconds)

    return SourceKind(name="list", selected=lambda settings: True, build=build)


def thermal_batches(start: float, cycles: int, hot_from: float) -> list[list[NodeSample]]:
    """Two nodes of job 71001, 4 GPUs each, a sample a second, in 5 s batches; dgx-02 GPU 1 runs hot (95 °C,
    SW thermal slowdown) from hot_from on. Each batch ends at the cycle's clock."""
    batches = []
    for k in range(1, cycles + 1):
        times = range(int(start) + 5 * (k - 1) + 1, int(start) + 5 * k + 1)
        batches.append(
            [
                parse_snapshot(
                    {
                        "schema": 1,
                        "node": node,
                        "time": float(t),
                        "gpus": [job_gpu(node, i, node == "dgx-02" and i == 1 and t >= hot_from) for i in range(4)],
                    }
                )
                for t in times
                for node in NODES
            ]
        )
    return batches


def metrics(runtime: Runtime) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(build_registry(runtime)).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_toy_source_runs_the_pipeline_metrics_healthz_and_nodes(tmp_path) -> None:
    pytest.importorskip("gpufleet.server.engine", reason="engine not written yet")
    now = [10_000.0]
    start = now[0]
    batches: list[list[NodeSample]] = [[]] + thermal_batches(start, 40, hot_from=start + 60)
    settings = ServerSettings(storage_path=str(tmp_path / "toy.db"))
    runtime = build_runtime(settings, clock=lambda: now[0], source_kinds=(list_kind(batches), *sample_sources()))
    source = runtime.source
    assert isinstance(source, ListSource)
    client = TestClient(create_app(settings, runtime=runtime, run_pipeline=False))

    asyncio.run(runtime.cycle())  # nothing listed yet: blind, said by /healthz and /metrics
    health = client.get("/healthz").json()
    assert (health["status"], health["degraded_reason"], health["targets"]) == ("degraded", "no_targets", 0)
    got = metrics(runtime)
    assert got[("gpufleet_server_blind", ())] == 1
    assert got[("gpufleet_server_blind_cycles_total", (("reason", "no_targets"),))] == 1

    async def scenario() -> None:
        while source.batches:
            now[0] += 5
            await runtime.cycle()

    asyncio.run(scenario())
    fired = [a for a in runtime.store.open_alerts() if a.kind.value == "thermal_throttle"]
    assert [(a.node, a.gpu, a.hpc_job) for a in fired] == [("dgx-02", 1, "71001")]
    assert runtime.view.stats["samples_ingested"] == len(NODES) * 4 * 200  # GPU-samples: every one, none twice

    health = client.get("/healthz").json()
    assert (health["status"], health["targets"], health["targets_up"]) == ("ok", 2, 2)
    nodes = client.get("/nodes").json()
    assert [(t["target"], t["node"], t["up"]) for t in nodes["targets"]] == [
        ("list:dgx-01", "dgx-01", True),
        ("list:dgx-02", "dgx-02", True),
    ]
    assert {n["node"] for n in nodes["nodes"]} == set(NODES)
    got = metrics(runtime)
    assert got[("gpufleet_server_blind", ())] == 0
    assert got[("gpufleet_server_samples_ingested_total", ())] == len(NODES) * 200
    assert got[("gpufleet_server_pulls_total", ())] == 41
    assert got[("gpufleet_server_target_up", (("target", "list:dgx-02"),))] == 1
    assert got[("gpufleet_server_target_last_sample_timestamp_seconds", (("target", "list:dgx-02"),))] == now[0]
    active = [dict(labels) for name, labels in got if name == "gpufleet_alert_active"]
    assert [(a["kind"], a["node"], a["gpu"]) for a in active] == [("thermal_throttle", "dgx-02", "1")]
    runtime.store.close()


def test_the_first_kind_the_settings_select_is_built_with_the_wiring() -> None:
    clock = lambda: 42.0  # noqa: E731
    batches: list[list[NodeSample]] = []
    toy = list_kind(batches)
    settings = ServerSettings(targets=("a:1",), pull_stale_after_seconds=7.0)
    source = build_source(settings, clock=clock, kinds=(toy, *sample_sources()))
    assert isinstance(source, ListSource) and source.stale_after_seconds == 7.0 and source._clock is clock
    assert source_kind(settings).name == "agents"
    assert source_kind(replace(settings, targets=(), prometheus_url="http://prom:9090")).name == "prometheus"
    assert source_kind(settings, (*sample_sources(), toy)).name == "agents"  # tried in order


def _families(source: SampleSource, tmp_path, name: str) -> set[str]:
    settings = ServerSettings()
    store = AlertStore(tmp_path / f"{name}.db")
    runtime = Runtime(engine=build_engine(settings), source=source, store=store, clock=lambda: 100.0)
    asyncio.run(runtime.cycle())
    names = {
        family.name for family in text_string_to_metric_families(generate_latest(build_registry(runtime)).decode())
    }
    runtime.store.close()
    return names


def test_every_source_exports_the_same_metric_families(tmp_path) -> None:
    """/metrics reads a source through the protocol alone: the toy, the puller and the Prometheus source give the
    same families, the ones only some sources fill (dcgm-exporter's missing readings) included."""
    snap = {"schema": 1, "node": "n1", "time": 99.0, "gpus": [job_gpu("n1", 0, False)]}
    agent = orjson.dumps(envelope("n1", [snap]))
    up = {"status": "success", "data": {"resultType": "vector", "result": []}}
    empty = {"status": "success", "data": {"resultType": "matrix", "result": []}}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/snapshots":
            return httpx.Response(200, content=agent)
        query = request.url.params["query"]
        return httpx.Response(200, content=orjson.dumps(up if query.startswith("up") else empty))

    def built(settings: ServerSettings, kinds: tuple[SourceKind, ...] | None = None) -> SampleSource:
        return build_source(settings, clock=lambda: 100.0, transport=httpx.MockTransport(handler), kinds=kinds)

    toy = _families(built(ServerSettings(), (list_kind([[parse_snapshot(snap)]]),)), tmp_path, "toy")
    agents = _families(built(ServerSettings(targets=("10.0.0.1:9471",))), tmp_path, "agents")
    prom = _families(built(ServerSettings(prometheus_url="http://prom:9090")), tmp_path, "prom")
    assert toy == agents == prom
    assert {"gpufleet_server_blind_cycles", "gpufleet_server_source_reading_missing", "gpufleet_server_targets"} <= toy
