"""Nodes whose agents leave discovery: their alerts resolve after a grace period, saying why, and stay
resolved across a restart; the engine frees what it held about them."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from gpufleet.server.alerts import AlertKind, AlertState
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.runtime import REMOVED_REASON, Runtime
from gpufleet.server.serve import build_engine
from gpufleet.server.settings import ServerSettings, load_settings
from gpufleet.server.store import AlertQuery, AlertStore
from tests.server.engine_samples import T0, cluster_lines
from tests.server.live_fakes import envelope

GRACE = 60.0


class Targets:
    """A discovery source whose answer the test edits."""

    def __init__(self, targets: list[str]) -> None:
        self.current = list(targets)

    def targets(self) -> list[str]:
        return sorted(self.current)


class Agents:
    """Agents n0, n1 (10.0.0.1, 10.0.0.2) serving cluster_lines as they are taken; `down` ones refuse."""

    def __init__(self, now: list[float], *, named: bool = True) -> None:
        self.now, self.named = now, named
        self.down: set[str] = set()
        self.by_node: dict[str, list[dict]] = {}
        for line in cluster_lines(3600, nodes=2):
            snap = orjson.loads(line)
            self.by_node.setdefault(snap["node"], []).append(snap)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        node = f"n{int(request.url.host.rsplit('.', 1)[1]) - 1}"
        if node in self.down:
            raise httpx.ConnectError("refused", request=request)
        since = request.url.params.get("since")
        snaps = [
            s
            for s in self.by_node[node]
            if s["time"] <= self.now[0] and s["time"] > (float(since) if since else self.now[0] - 60)
        ]
        body = {**envelope(node, snaps), "time": self.now[0]}
        if not self.named:
            del body["node"]
        return httpx.Response(200, content=orjson.dumps(body))


def _runtime(tmp_path, now, agents, targets) -> Runtime:
    settings = ServerSettings(storage_path=str(tmp_path / "alerts.db"))
    puller = Puller(targets, transport=httpx.MockTransport(agents), clock=lambda: now[0])
    return Runtime(
        engine=build_engine(settings),
        source=puller,
        store=AlertStore(settings.storage_path),
        clock=lambda: now[0],
        removed_grace_seconds=GRACE,
    )


def _run(runtime: Runtime, now: list[float], until: float, each=None) -> None:
    async def cycles():
        while now[0] < until:
            now[0] += 5
            await runtime.cycle()
            if each:
                each()
        await runtime.source.aclose()

    asyncio.run(cycles())


def _resolved(store: AlertStore) -> list:
    return store.query(AlertQuery(state=AlertState.RESOLVED, limit=1000)).alerts


def test_a_node_removed_from_discovery_resolves_after_the_grace_and_stays_resolved_after_a_restart(tmp_path):
    now = [T0 + 2.0]
    agents = Agents(now)
    targets = Targets(["10.0.0.1:9471", "10.0.0.2:9471"])
    runtime = _runtime(tmp_path, now, agents, targets)
    _run(runtime, now, T0 + 300)
    agents.down.add("n1")  # the node dies...
    _run(runtime, now, T0 + 400)
    (open_,) = runtime.store.open_alerts()
    assert (open_.kind, open_.node, open_.state) == (AlertKind.NODE_UNREACHABLE, "n1", AlertState.FIRING)
    targets.current.remove("10.0.0.2:9471")  # ... and is taken out of the fleet
    removed_at = now[0]
    resolved_at = []

    def watch():
        if not runtime.store.open_alerts() and not resolved_at:
            resolved_at.append(now[0])

    _run(runtime, now, removed_at + 2 * GRACE, watch)
    assert removed_at + GRACE <= resolved_at[0] <= removed_at + GRACE + 5
    gone = runtime.store.get(open_.id)
    assert gone.state is AlertState.RESOLVED and gone.evidence["resolved_reason"] == REMOVED_REASON
    # The engine holds nothing about it any more.
    engine = runtime.engine
    assert [n["node"] for n in runtime.view.nodes] == ["n0"]
    assert "n1" not in engine.windows._nodes
    slots = [s for (node, _), s in engine.windows.slot_of.items() if node == "n1"]
    assert (engine.windows.bin_id[:, slots] == -1).all() and (engine.windows.slot_job[slots] == -1).all()
    runtime.store.close()

    restarted = _runtime(tmp_path, now, agents, Targets(["10.0.0.1:9471"]))
    assert restarted.restore() == 0
    _run(restarted, now, now[0] + 2 * GRACE)
    assert restarted.store.open_alerts() == []
    restarted.store.close()


def test_a_restart_with_no_targets_resolves_the_restored_alerts_after_the_grace(tmp_path):
    now = [T0 + 2.0]
    agents = Agents(now)
    runtime = _runtime(tmp_path, now, agents, Targets(["10.0.0.1:9471", "10.0.0.2:9471"]))
    _run(runtime, now, T0 + 300)
    agents.down.add("n1")
    _run(runtime, now, T0 + 400)
    assert [a.node for a in runtime.store.open_alerts()] == ["n1"]
    runtime.store.close()

    empty = _runtime(tmp_path, now, agents, Targets([]))
    assert empty.restore() == 1
    started = now[0]
    _run(empty, now, started + GRACE - 5)
    assert [a.node for a in empty.store.open_alerts()] == ["n1"]  # within the grace: still firing
    _run(empty, now, started + GRACE + 5)
    assert empty.store.open_alerts() == []
    assert _resolved(empty.store)[0].evidence["resolved_reason"] == REMOVED_REASON
    empty.store.close()
    again = _runtime(tmp_path, now, agents, Targets([]))
    assert again.restore() == 0
    again.store.close()


def test_a_node_back_under_a_new_address_within_the_grace_keeps_its_state(tmp_path):
    now = [T0 + 2.0]
    agents = Agents(now)
    targets = Targets(["10.0.0.1:9471", "10.0.0.2:9471"])
    runtime = _runtime(tmp_path, now, agents, targets)
    _run(runtime, now, T0 + 300)
    slots_before = dict(runtime.engine.windows.slot_of)
    targets.current = ["10.0.0.1:9471"]
    _run(runtime, now, T0 + 330)
    # 10.0.0.2 again here: a pod rescheduled and given its address back, within the grace.
    targets.current = ["10.0.0.1:9471", "10.0.0.2:9471"]
    _run(runtime, now, T0 + 300 + 3 * GRACE)
    assert runtime.store.open_alerts() == [] and _resolved(runtime.store) == []
    assert runtime.engine.windows.slot_of == slots_before and "n1" in runtime.engine.windows._nodes
    runtime.store.close()


def test_a_node_still_sending_is_kept_though_no_target_names_it(tmp_path):
    # Agents that do not name their node in the envelope: no target claims n0 or n1, but their samples
    # keep arriving, so neither has gone anywhere.
    now = [T0 + 2.0]
    runtime = _runtime(tmp_path, now, Agents(now, named=False), Targets(["10.0.0.1:9471", "10.0.0.2:9471"]))
    _run(runtime, now, T0 + 300 + 3 * GRACE)
    assert sorted(n["node"] for n in runtime.view.nodes) == ["n0", "n1"]
    assert runtime.store.open_alerts() == []
    runtime.store.close()


def test_the_grace_is_a_setting():
    assert load_settings([]).targets_removed_grace_seconds == 300.0
    assert load_settings(["--targets.removed-grace", "10m"]).targets_removed_grace_seconds == 600.0
