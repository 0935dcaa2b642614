"""The engine's work per advance() is bounded by its window, whatever sample times arrive."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from gpufleet.server.api import create_app
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig
from gpufleet.server.replay import run_replay
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings
from tests.server.engine_samples import T0, cluster_lines, healthy, sample
from tests.server.live_fakes import envelope

# A window of 300 s is 60 ticks of 5 s: a bounded advance evaluates about that many, an unbounded one
# evaluates every tick since the oldest time it was given (from time=1000: about 350 million).
_RING = 60


class _TickBudget(Exception):
    pass


@pytest.fixture
def counted(monkeypatch):
    """Engines whose evaluated ticks are counted, and that stop with an error past a budget (so an
    unbounded walk fails at once instead of running for hours)."""
    evaluated = []

    def bounded_evaluate(self, k, original=Engine._evaluate):
        evaluated.append(k)
        if len(evaluated) > 20 * _RING:
            raise _TickBudget(f"evaluated {len(evaluated)} ticks")
        return original(self, k)

    monkeypatch.setattr(Engine, "_evaluate", bounded_evaluate)
    return evaluated


def _cluster(eng: Engine, seconds: float, t0: float = T0) -> None:
    for line in cluster_lines(seconds, t0=t0):
        eng.ingest(parse_line(line))


def test_an_old_snapshot_in_a_fresh_engines_first_cycle_is_dropped_not_walked_from(counted):
    eng = Engine()
    eng.ingest(sample("n9", 1000.0, [healthy(0)]))  # an agent clock at the epoch, or an ancient buffer
    _cluster(eng, 60)
    eng.advance(T0 + 65)
    assert len(counted) == 13  # T0 .. T0 + 60: where the kept samples begin
    stats = eng.stats()
    assert stats.too_old_snapshots_dropped == 1
    assert "n9" not in {n.node for n in eng.nodes()}
    assert stats.last_tick_time == T0 + 65


def test_a_first_cycle_of_only_old_snapshots_starts_a_window_before_now(counted):
    eng = Engine()
    _cluster(eng, 60, t0=T0 - 2 * 86_400)  # agents serving what they held before an outage
    eng.advance(T0)
    assert len(counted) <= _RING + 1
    assert eng.stats().too_old_snapshots_dropped == len(cluster_lines(60))
    assert eng.alerts() == []


def test_a_snapshot_older_than_the_window_behind_its_nodes_newest_is_counted_and_dropped(counted):
    eng = Engine()
    _cluster(eng, 120)
    eng.advance(T0 + 125)
    last = {n.node: n.last_sample_time for n in eng.nodes()}
    eng.ingest(sample("n0", T0 + 120 - 400.0, [healthy(g) for g in range(8)]))  # 400 s behind n0's newest
    eng.ingest(sample("n1", T0 + 120 - 200.0, [healthy(g) for g in range(8)]))  # late, but within the window
    eng.advance(T0 + 130)
    assert eng.stats().too_old_snapshots_dropped == 1
    assert {n.node: n.last_sample_time for n in eng.nodes()} == last


def test_a_day_long_jump_of_now_without_new_samples_is_one_silence(counted):
    eng = Engine()
    _cluster(eng, 60)
    eng.advance(T0 + 65)
    before = len(counted)
    transitions = eng.advance(T0 + 86_400)
    assert len(counted) - before <= _RING + 1
    assert eng.stats().last_tick_time == T0 + 86_400
    # The silence was judged: both nodes stopped answering.
    assert {t.alert.node for t in transitions if t.alert.kind.value == "node_unreachable"} == {"n0", "n1"}


def test_replay_of_a_trace_whose_only_snapshot_lists_no_gpu_finds_nothing():
    assert run_replay([b'{"schema":1,"node":"a","time":1,"gpus":[]}']) == []


def test_snapshots_without_gpus_then_real_ones_are_evaluated_from_the_real_ones(counted):
    eng = Engine(EngineConfig())
    eng.ingest(sample("a", 1.0, []))
    assert eng.advance(10.0) == []
    _cluster(eng, 60)
    eng.advance(T0 + 65)
    assert len(counted) <= 13 and eng.stats().last_tick_time == T0 + 65


def test_a_fresh_servers_first_cycle_with_an_agent_serving_an_ancient_snapshot_stays_bounded(tmp_path, counted):
    """The live path: the puller rejects what is far behind its clock, the engine drops what is behind its
    window, and both are counted on /metrics."""
    now = [T0 + 62.0]
    lines = [orjson.loads(line) for line in cluster_lines(60)]
    ancient = {**lines[0], "time": 1000.0}
    stale = {**lines[1], "time": T0 - 1800.0}  # half an hour old: the puller lets it through

    def agent(request: httpx.Request) -> httpx.Response:
        node = f"n{int(request.url.host.rsplit('.', 1)[1]) - 1}"
        snaps = [s for s in lines if s["node"] == node]
        snaps = ([ancient] if node == "n0" else [stale]) + snaps
        return httpx.Response(200, content=orjson.dumps({**envelope(node, snaps), "time": now[0]}))

    settings = ServerSettings(targets=("10.0.0.1:9471", "10.0.0.2:9471"), storage_path=str(tmp_path / "a.db"))
    runtime = build_runtime(settings, clock=lambda: now[0], transport=httpx.MockTransport(agent))
    client = TestClient(create_app(settings, runtime=runtime, run_pipeline=False))

    async def cycle():
        await runtime.cycle()
        await runtime.source.aclose()

    asyncio.run(cycle())
    assert 0 < len(counted) <= _RING + 1
    metrics = client.get("/metrics").text
    assert 'gpufleet_server_rejected_total{reason="too_old"} 1.0' in metrics
    assert 'gpufleet_server_samples_dropped_total{reason="too_old"} 1.0' in metrics
    runtime.store.close()
