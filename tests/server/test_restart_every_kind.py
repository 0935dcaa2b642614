"""A restart in the middle of an incident keeps its alert, whatever the kind: the real engine, a real store
file and the puller over agents that serve a generated trace.

Each case takes one evaluation scenario (bench/evaluation) whose incident raises the kind, runs the server's
pipeline until the alert fires, stops it (as SIGKILL leaves it, or as SIGTERM does) and starts a new one on
the same store. The new engine knows nothing but the restored alert and the warm-up its first pulls ask for;
its detector has not re-learned what it judges by. The alert must keep its id and start, no resolve may
reach the notifier while the incident lasts, and it resolves once, under the same id, after the incident.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Sequence

import httpx
import orjson
import pytest

from bench.evaluation import scenarios
from bench.evaluation.tracegen import Trace, generate
from gpufleet.server.alerts import Alert, AlertState, Transition
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings

PORT = 9471
RING_SECONDS = 300.0  # what a gpufleet agent keeps by default
DOWN_SECONDS = 10.0  # between the old process's end and the new one's first pull


@dataclass(frozen=True)
class Case:
    """A scenario and seed whose trace raises `kind`; `extend_s` lengthens it so the alert can clear."""

    scenario: str
    seed: int
    kind: str
    extend_s: float = 0.0


CASES = {
    "straggler": Case("silent_slow_gpu", 0, "straggler"),
    "comm_bound": Case("comm_slowdown", 0, "comm_bound"),
    "input_bound": Case("input_starved", 0, "input_bound"),
    "thermal_throttle": Case("hot_gpu", 0, "thermal_throttle"),
    # The GPU stays off the bus to the trace's end: its alert must simply stay open.
    "gpu_lost": Case("gpu_lost", 0, "gpu_lost"),
    # XID and ECC alerts clear a quiet while (xid/ecc_clear_seconds) after their last error.
    "xid": Case("xid_burst", 6, "xid", extend_s=480.0),
    "ecc": Case("xid_burst", 6, "ecc", extend_s=480.0),
    "node_unreachable": Case("agent_down", 0, "node_unreachable"),
}


class TraceAgents:
    """One gpufleet agent per node of a trace: a snapshot joins its node's ring once the clock passes its
    time, `since=` and `span=` are honoured as the agent does, and while the trace has the agent down its
    target refuses connections."""

    def __init__(self, trace: Trace, now: list[float]) -> None:
        self.now = now
        self.snapshots: dict[str, list[dict]] = {}
        for line in trace.lines:
            snap = orjson.loads(line)
            self.snapshots.setdefault(snap["node"], []).append(snap)
        for snaps in self.snapshots.values():
            snaps.sort(key=lambda s: s["time"])
        t0 = trace.spec.t0
        self.down = [
            (i.node, t0 + i.start_s, t0 + i.end_s)
            for i in trace.spec.incidents
            if i.kind in ("agent_down", "node_crash")
        ]

    def targets(self) -> tuple[str, ...]:
        return tuple(f"{node}:{PORT}" for node in sorted(self.snapshots))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        node, now = request.url.host, self.now[0]
        if any(n == node and start <= now < end for n, start, end in self.down):
            raise httpx.ConnectError("connection refused")
        since, span = request.url.params.get("since"), request.url.params.get("span")
        ring = [s for s in self.snapshots[node] if now - RING_SECONDS < s["time"] <= now]
        newest = ring[-1]["time"] if ring else now
        floor = max(float(since) if since else -1.0, newest - float(span) if span else -1.0)
        body = {"schema": 1, "node": node, "time": now, "snapshots": [s for s in ring if s["time"] > floor]}
        return httpx.Response(200, content=orjson.dumps(body))


class Recorder:
    """A notifier that keeps every transition it is handed."""

    name = "recorder"
    url = "memory:"
    sent_total = failed_total = dropped_total = 0

    def __init__(self) -> None:
        self.transitions: list[Transition] = []

    def submit(self, transitions: Sequence[Transition]) -> None:
        self.transitions.extend(transitions)

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def aclose(self) -> None:
        pass


def _runtime(settings: ServerSettings, agents: TraceAgents, now: list[float], recorder: Recorder) -> Runtime:
    return build_runtime(
        settings, clock=lambda: now[0], transport=httpx.MockTransport(agents), extra_notifiers=[recorder]
    )


def _watched(alerts: Sequence[Alert], kind: str) -> Alert | None:
    return next((a for a in alerts if a.kind.value == kind and a.state is AlertState.FIRING), None)


async def _until_end(runtime: Runtime, now: list[float], end: float, pull_s: float) -> None:
    while now[0] < end:
        now[0] += pull_s
        await runtime.cycle()
    await runtime.stop()


@pytest.fixture(scope="module", params=list(CASES))
def case_trace(request, tmp_path_factory) -> tuple[Case, Trace, bool]:
    """The case, its trace, and whether the alert resolves within it when nothing restarts."""
    case = CASES[request.param]
    spec = scenarios.BY_NAME[case.scenario].build(case.seed)
    trace = generate(replace(spec, duration_s=spec.duration_s + case.extend_s))
    now = [trace.spec.t0]
    agents = TraceAgents(trace, now)
    path = tmp_path_factory.mktemp("unrestarted") / "alerts.db"
    settings = ServerSettings(targets=agents.targets(), storage_path=str(path))
    recorder = Recorder()
    end = trace.spec.t0 + trace.spec.duration_s
    asyncio.run(_until_end(_runtime(settings, agents, now, recorder), now, end, settings.pull_interval_seconds))
    mine = [t.alert for t in recorder.transitions if t.alert.kind.value == case.kind]
    assert mine, f"no {case.kind} in {case.scenario} seed {case.seed}"
    resolved = [a.resolved for a in mine if a.state is AlertState.RESOLVED]
    return case, trace, resolved[0] if resolved else None


@pytest.mark.parametrize("stop", ["sigkill", "sigterm"])
def test_a_restart_mid_incident_keeps_the_alert_and_resolves_it_once_after(tmp_path, case_trace, stop) -> None:
    case, trace, resolves = case_trace
    t0, end = trace.spec.t0, trace.spec.t0 + trace.spec.duration_s
    now = [t0]
    agents = TraceAgents(trace, now)
    settings = ServerSettings(targets=agents.targets(), storage_path=str(tmp_path / "alerts.db"))
    pull_s = settings.pull_interval_seconds

    async def run() -> tuple[Alert, list[Transition], Alert | None]:
        first = _runtime(settings, agents, now, Recorder())
        fired = None
        while fired is None or now[0] < (fired.started or 0) + 30:
            assert now[0] < end, f"no {case.kind} in {case.scenario} seed {case.seed}"
            now[0] += pull_s
            await first.cycle()
            fired = fired or _watched(first.view.alerts, case.kind)
        assert resolves is None or now[0] < resolves, "the restart must fall while the alert is open"
        if stop == "sigterm":
            await first.stop()
        else:  # every cycle's changes are written already: a killed process leaves the store as it is
            first.store.close()
            await first.source.aclose()

        now[0] += DOWN_SECONDS
        recorder = Recorder()
        second = _runtime(settings, agents, now, recorder)
        second.restore()
        restored = _watched(second.view.alerts, case.kind)
        await _until_end(second, now, end, pull_s)
        return fired, recorder.transitions, restored

    fired, after, restored = asyncio.run(run())
    assert restored is not None and (restored.id, restored.started) == (fired.id, fired.started)
    subject = [t for t in after if t.alert.fingerprint == fired.fingerprint]
    assert {t.alert.id for t in subject} == {fired.id}, "re-paged under a new id"
    resolved = [t.alert for t in subject if t.alert.state is AlertState.RESOLVED]
    assert len(resolved) == (1 if resolves is not None else 0), "resolved as often as without the restart"
    # No earlier than without the restart (a pull or two apart: the new engine's windows began afresh).
    for a in resolved:
        assert a.resolved is not None and resolves is not None and a.resolved >= resolves - 2 * pull_s, (
            f"resolved at +{a.resolved - t0:.0f}s, where without the restart at +{resolves - t0:.0f}s"
        )


def test_only_an_alert_taken_over_at_a_restart_offers_its_evidence_to_the_detectors() -> None:
    # The workload detector judges a taken-over alert by the baselines in its evidence; an alert this engine
    # opened itself must keep being judged by the engine's own history.
    from gpufleet.server.alerts import AlertKind, Severity
    from gpufleet.server.engine.detectors import Finding, Outcome
    from gpufleet.server.engine.lifecycle import Lifecycle
    from tests.server.live_fakes import make_alert

    lifecycle = Lifecycle({AlertKind.COMM_BOUND: (0.0, 60.0)})
    taken_over = make_alert(1, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job="71001")
    assert lifecycle.restore([taken_over]) == 1
    found = Finding(AlertKind.COMM_BOUND, None, None, None, "71002", Severity.WARNING, "waits", {"baseline": 0.6})
    outcome = Outcome()
    outcome.add(found)
    lifecycle.step(2000.0, {AlertKind.COMM_BOUND: outcome})
    assert lifecycle.restored_evidence(taken_over.fingerprint) == taken_over.evidence
    assert found.fingerprint in lifecycle.records and lifecycle.restored_evidence(found.fingerprint) is None
    assert lifecycle.restored_evidence("no-such-alert") is None
