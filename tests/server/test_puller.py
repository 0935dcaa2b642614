"""The puller: since-tracking, concurrency over targets, rejection of bad payloads, per-target health and alerts."""

from __future__ import annotations

import asyncio
import json

import httpx
import orjson

from gpufleet.server.alerts import AlertKind, AlertState, Severity, description
from gpufleet.server.ingest.agent_alerts import AgentAlerts, is_ours
from gpufleet.server.ingest.base import TargetHealth
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from tests.server.live_fakes import envelope, make_alert, parse_dict, snapshot


class FakeAgents:
    """A MockTransport handler serving /snapshots for several nodes from per-node buffers."""

    def __init__(self, nodes: dict[str, str]) -> None:
        self.nodes = nodes  # target -> node name
        self.buffers: dict[str, list[dict]] = {t: [] for t in nodes}
        self.requests: list[tuple[str, str | None]] = []
        self.override: dict[str, httpx.Response | Exception] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        target = f"{request.url.host}:{request.url.port}"
        since = request.url.params.get("since")
        self.requests.append((target, since))
        assert request.url.path == "/snapshots"
        special = self.override.get(target)
        if isinstance(special, Exception):
            raise special
        if special is not None:
            return special
        newer = [s for s in self.buffers[target] if since is None or (isinstance(s, dict) and s["time"] > float(since))]
        return httpx.Response(200, content=orjson.dumps(envelope(self.nodes[target], newer)))


def make_puller(agents: FakeAgents, **kwargs) -> tuple[Puller, list[float]]:
    # Most of these tests stamp samples with small numbers far from the server's clock; the clock-offset
    # tests turn the correction back on.
    kwargs.setdefault("clock_offset_min_seconds", 0.0)
    now = [1000.0]
    puller = Puller(
        StaticTargets(tuple(agents.nodes)),
        transport=httpx.MockTransport(agents.handler),
        clock=lambda: now[0],
        parse=parse_dict,
        **kwargs,
    )
    return puller, now


def run(coro):
    return asyncio.run(coro)


def test_since_is_tracked_per_target_so_nothing_is_lost_or_repeated() -> None:
    agents = FakeAgents({"a:9471": "dgx-01", "b:9471": "dgx-02"})
    puller, now = make_puller(agents)

    async def scenario():
        agents.buffers["a:9471"] = [snapshot("dgx-01", t) for t in (1.0, 2.0)]
        agents.buffers["b:9471"] = [snapshot("dgx-02", 1.5)]
        first = await puller.pull_once()
        agents.buffers["a:9471"].append(snapshot("dgx-01", 3.0))
        second = await puller.pull_once()
        third = await puller.pull_once()
        await puller.aclose()
        return first, second, third

    first, second, third = run(scenario())
    assert sorted((s["node"], s["time"]) for s in first.samples) == [("dgx-01", 1.0), ("dgx-01", 2.0), ("dgx-02", 1.5)]
    assert [(s["node"], s["time"]) for s in second.samples] == [("dgx-01", 3.0)]
    assert third.samples == []
    sinces = {t: [s for tt, s in agents.requests if tt == t] for t in agents.nodes}
    assert sinces["a:9471"] == [None, "2.0", "3.0"]
    assert sinces["b:9471"] == [None, "1.5", "1.5"]
    assert puller.samples_total == 4 and puller.pulls_total == 6


def test_agent_ignoring_since_is_not_ingested_twice() -> None:
    agents = FakeAgents({"a:1": "n1"})
    agents.override["a:1"] = httpx.Response(200, content=orjson.dumps(envelope("n1", [snapshot("n1", 5.0)])))
    puller, _ = make_puller(agents)

    async def scenario():
        return [len((await puller.pull_once()).samples) for _ in range(3)]

    assert run(scenario()) == [1, 0, 0]


def test_bad_payloads_are_rejected_counted_and_do_not_poison_other_targets() -> None:
    agents = FakeAgents(
        {
            "good:1": "ok",
            "json:1": "x",
            "env:1": "x",
            "big:1": "x",
            "http:1": "x",
            "down:1": "x",
            "slow:1": "x",
            "schema2:1": "x",
        }
    )
    agents.buffers["good:1"] = [snapshot("ok", 1.0)]
    agents.override.update(
        {
            "json:1": httpx.Response(200, content=b"{not json"),
            "env:1": httpx.Response(200, content=b'{"schema": 1, "snapshots": 7}'),
            "schema2:1": httpx.Response(200, content=b'{"schema": 2, "snapshots": []}'),
            "big:1": httpx.Response(200, content=b"[" + b" " * 5000 + b"]"),
            "http:1": httpx.Response(503, content=b'{"status": "stale"}'),
            "down:1": httpx.ConnectError("refused"),
            "slow:1": httpx.ReadTimeout("slow"),
        }
    )
    puller, _ = make_puller(agents, max_payload_bytes=4096)
    result = run(puller.pull_once())
    assert [s["node"] for s in result.samples] == ["ok"]
    assert result.failed_targets == 7
    reasons = {target: reason for (target, reason) in puller.errors}
    assert reasons == {
        "json:1": "malformed_json",
        "env:1": "schema",
        "schema2:1": "schema",
        "big:1": "oversized",
        "http:1": "http_status",
        "down:1": "connect",
        "slow:1": "timeout",
    }
    health = {h.target: h for h in puller.health()}
    assert health["good:1"].up and health["good:1"].node == "ok" and health["good:1"].last_sample_time == 1.0
    assert not health["down:1"].up and health["down:1"].consecutive_failures == 1
    assert "connect" in (health["down:1"].last_error or "")


def test_schema_violating_snapshot_is_dropped_alone_and_since_moves_past_it() -> None:
    agents = FakeAgents({"a:1": "n1"})
    bad = {"schema": 1, "node": "n1", "time": 2.0, "gpus": "nope"}
    agents.buffers["a:1"] = [snapshot("n1", 1.0), bad, snapshot("n1", 3.0), "garbage"]
    puller, _ = make_puller(agents)

    async def scenario():
        first = await puller.pull_once()
        second = await puller.pull_once()
        return first, second

    first, second = run(scenario())
    assert [s["time"] for s in first.samples] == [1.0, 3.0]
    assert first.rejected_snapshots == 2 and first.failed_targets == 0
    assert puller.errors[("a:1", "schema")] == 2
    assert second.samples == [] and agents.requests[-1] == ("a:1", "3.0")


def test_health_tracks_failures_recovery_and_staleness() -> None:
    agents = FakeAgents({"a:1": "n1"})
    agents.buffers["a:1"] = [snapshot("n1", 1.0)]
    puller, now = make_puller(agents, stale_after_seconds=30)

    async def scenario():
        await puller.pull_once()
        agents.override["a:1"] = httpx.ConnectError("refused")
        for _ in range(3):
            now[0] += 5
            await puller.pull_once()
        down = puller.health()[0]
        del agents.override["a:1"]
        now[0] += 5
        await puller.pull_once()
        recovered = puller.health()[0]
        now[0] += 31
        await puller.pull_once()
        return down, recovered, puller.health()[0]

    down, recovered, stale = run(scenario())
    assert (down.up, down.consecutive_failures, down.last_success) == (False, 3, 1000.0)
    assert (recovered.up, recovered.consecutive_failures, recovered.stale) == (True, 0, False)
    assert stale.up and stale.stale and stale.last_sample_time == 1.0


def test_removed_targets_are_forgotten_and_discovery_errors_keep_last_set() -> None:
    agents = FakeAgents({"a:1": "n1", "b:1": "n2"})

    class Flaky:
        def __init__(self) -> None:
            self.answers: list[object] = [["a:1", "b:1"], ["a:1"], RuntimeError("bug")]

        def targets(self) -> list[str]:
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer  # type: ignore[return-value]

    puller = Puller(Flaky(), transport=httpx.MockTransport(agents.handler), parse=parse_dict)

    async def scenario():
        counts = []
        for _ in range(3):
            counts.append((await puller.pull_once()).targets)
        return counts

    assert run(scenario()) == [2, 1, 1]
    assert [h.target for h in puller.health()] == ["a:1"]


def test_a_removed_target_takes_its_error_series_along_but_not_its_counts() -> None:
    # On Kubernetes every agent restart is a new pod address: per-target series of the gone ones would
    # pile up in /metrics, while the totals by reason must never go down (Prometheus reads that as a reset).
    agents = FakeAgents({"a:1": "n1", "b:1": "n2"})
    agents.override["b:1"] = httpx.Response(200, content=b"garbage")
    answers = [["a:1", "b:1"], ["a:1", "b:1"], ["a:1"]]

    class Shrinking:
        def targets(self) -> list[str]:
            return answers.pop(0)

    puller = Puller(Shrinking(), transport=httpx.MockTransport(agents.handler), parse=parse_dict)

    async def cycles(n):
        for _ in range(n):
            await puller.pull_once()

    run(cycles(2))
    assert puller.errors == {("b:1", "malformed_json"): 2} and puller.errors_by_reason() == {"malformed_json": 2}
    run(cycles(1))
    assert puller.errors == {} and puller.errors_by_reason() == {"malformed_json": 2}


def test_real_parser_rejects_contract_violations_when_available() -> None:
    """With the engine's own contract parser, a snapshot missing required fields is rejected, not raised."""
    import pytest

    contract = pytest.importorskip("gpufleet.server.contract", reason="engine contract module not written yet")
    agents = FakeAgents({"a:1": "n1"})
    good = snapshot("n1", 1.0)
    agents.buffers["a:1"] = [{"schema": 1, "node": "n1", "time": "soon"}, good]
    puller = Puller(
        StaticTargets(("a:1",)), transport=httpx.MockTransport(agents.handler), parse=contract.parse_snapshot
    )
    result = run(puller.pull_once())
    assert result.rejected_snapshots == 1
    assert len(result.samples) == 1
    assert json.dumps(puller.errors[("a:1", "schema")]) == "1"


def test_an_answer_that_trickles_is_cut_at_the_pull_timeout_and_others_still_arrive() -> None:
    """httpx times each read, not the whole answer; the puller bounds the whole pull."""
    stalled = asyncio.Event()  # never set: the body's second chunk never comes

    async def trickle():
        yield b'{"schema": 1, '
        await stalled.wait()

    good = orjson.dumps(envelope("ok", [snapshot("ok", 1.0)]))

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "stall":
            return httpx.Response(200, content=trickle())
        return httpx.Response(200, content=good)

    puller = Puller(
        StaticTargets(("stall:1", "good:1")),
        transport=httpx.MockTransport(handler),
        parse=parse_dict,
        timeout_seconds=0.05,
    )
    result = run(asyncio.wait_for(puller.pull_once(), timeout=30))
    assert [s["node"] for s in result.samples] == ["ok"]
    assert puller.errors == {("stall:1", "timeout"): 1}
    assert not {h.target: h for h in puller.health()}["stall:1"].up


def test_pulls_run_concurrently_up_to_the_limit() -> None:
    """Every handler waits until all pulls are in flight at once: sequential pulls would time out instead."""
    targets = [f"t{i}:1" for i in range(6)]
    in_flight, peak = [0], [0]

    async def scenario(concurrency: int) -> int:
        everyone = asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            if in_flight[0] == concurrency:
                everyone.set()
            await everyone.wait()
            in_flight[0] -= 1
            node = request.url.host
            return httpx.Response(200, content=orjson.dumps(envelope(node, [snapshot(node, 1.0)])))

        peak[0] = 0
        puller = Puller(
            StaticTargets(tuple(targets)),
            transport=httpx.MockTransport(handler),
            parse=parse_dict,
            concurrency=concurrency,
            timeout_seconds=20,
        )
        result = await asyncio.wait_for(puller.pull_once(), timeout=30)
        assert result.failed_targets == 0 and len(result.samples) == len(targets)
        return peak[0]

    assert run(scenario(len(targets))) == len(targets)
    assert run(scenario(2)) == 2


def test_one_keep_alive_connection_per_agent_across_pulls() -> None:
    """Against a real HTTP/1.1 server on 127.0.0.1: three pulls, one TCP connection."""
    connections: list[object] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer.get_extra_info("peername"))
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                body = orjson.dumps(envelope("n1", [snapshot("n1", 1.0)]))
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def scenario() -> list[int]:
        server = await asyncio.start_server(agent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        puller = Puller(StaticTargets((f"127.0.0.1:{port}",)), parse=parse_dict)
        counts = [len((await puller.pull_once()).samples) for _ in range(3)]
        await puller.aclose()
        server.close()
        await server.wait_closed()
        return counts

    assert run(scenario()) == [1, 0, 0]  # the agent ignores since; the repeats are not ingested
    assert len(connections) == 1


def test_a_sample_stamped_far_ahead_is_rejected_and_does_not_strand_since() -> None:
    """One bogus future time (or an unparseable huge one) must not make every later honest sample look old."""
    agents = FakeAgents({"a:1": "n1"})
    puller, now = make_puller(agents, max_future_seconds=300)  # server clock at 1000
    agents.buffers["a:1"] = [
        snapshot("n1", 990.0),
        snapshot("n1", 1000.0 + 3600),
        {**snapshot("n1", 995.0), "time": 1e300},
    ]

    async def scenario():
        first = await puller.pull_once()
        agents.buffers["a:1"] = [snapshot("n1", 1004.0)]
        now[0] = 1005.0
        second = await puller.pull_once()
        return first, second

    first, second = run(scenario())
    assert [s["time"] for s in first.samples] == [990.0] and first.rejected_snapshots == 2
    assert puller.errors[("a:1", "future_time")] == 2
    assert [s["time"] for s in second.samples] == [1004.0]
    assert agents.requests[1] == ("a:1", "990.0")


def _health(
    target: str, *, up: bool, stale: bool = False, node: str | None = None, last_success: float | None = None
) -> TargetHealth:
    return TargetHealth(
        target=target,
        node=node,
        up=up,
        stale=stale,
        last_success=last_success,
        consecutive_failures=0 if up else 3,
        last_error=None if up else "connect: refused",
    )


def test_agent_down_since_start_alerts_after_the_threshold_and_clears_once_the_engine_has_it() -> None:
    alerts = AgentAlerts(after_seconds=30)
    down = _health("10.0.0.4:9471", up=False)
    assert alerts.step([down], covered=set(), now=1000.0) == []
    assert alerts.step([down], covered=set(), now=1025.0) == []
    [fired] = alerts.step([down], covered=set(), now=1030.0)
    a = fired.alert
    assert (fired.previous, a.state, a.kind, a.severity) == (
        None,
        AlertState.FIRING,
        AlertKind.NODE_UNREACHABLE,
        Severity.CRITICAL,
    )
    assert (a.node, a.gpu, a.hpc_job, a.pending_since, a.started) == ("10.0.0.4:9471", None, None, 1000.0, 1030.0)
    assert "has not answered since the server started (connect: refused)" in a.summary
    assert a.evidence["target"] == "10.0.0.4:9471" and is_ours(a)
    assert description(a).endswith("check the node, its network and gpufleet-agent there.")  # health's advice
    assert alerts.step([down], covered=set(), now=1035.0) == []  # no refresh noise while it stays down
    assert alerts.alerts() == [a]
    up = _health("10.0.0.4:9471", up=True, node="dgx-04", last_success=1040.0)
    [resolved] = alerts.step([up], covered={"dgx-04"}, now=1040.0)
    assert (resolved.previous, resolved.alert.state, resolved.alert.resolved, resolved.alert.id) == (
        AlertState.FIRING,
        AlertState.RESOLVED,
        1040.0,
        a.id,
    )
    assert alerts.alerts() == []


def test_agent_answering_without_samples_alerts_as_soon_as_it_is_stale() -> None:
    alerts = AgentAlerts(after_seconds=30)
    [fired] = alerts.step([_health("a:1", up=True, stale=True, node="dgx-09")], covered=set(), now=50.0)
    assert fired.alert.node == "dgx-09" and fired.alert.evidence["reason"] == "stale"
    assert "answers but has sent no new sample" in fired.alert.summary
    assert "dgx-09 is not being watched" in fired.alert.summary


def test_nodes_the_engine_watches_are_left_to_the_engine_and_removed_targets_resolve() -> None:
    alerts = AgentAlerts(after_seconds=0)
    known = _health("a:1", up=False, node="dgx-01", last_success=10.0)
    assert alerts.step([known], covered={"dgx-01"}, now=100.0) == []  # the engine raises node_unreachable itself
    [fired] = alerts.step([_health("b:1", up=False)], covered=set(), now=100.0)
    [gone] = alerts.step([], covered=set(), now=105.0)
    assert gone.alert.id == fired.alert.id and gone.alert.state is AlertState.RESOLVED


def test_restore_takes_back_its_alerts_and_remembers_node_names() -> None:
    before = AgentAlerts(after_seconds=0)
    before.learn([_health("a:1", up=True, node="dgx-01")])
    [fired] = before.step([_health("b:1", up=False)], covered=set(), now=100.0)
    engine_alert = make_alert(1, kind=AlertKind.NODE_UNREACHABLE, node="dgx-01", gpu=None)

    after = AgentAlerts(after_seconds=0)
    assert after.restore([fired.alert, engine_alert], before.nodes) == 1
    assert after.alerts() == [fired.alert]
    # a:1 never answered since the restart, but its node is remembered: the engine's restored alert covers it
    assert after.step([_health("a:1", up=False), _health("b:1", up=False)], covered={"dgx-01"}, now=200.0) == []
    gone, named = after.step([_health("a:1", up=False)], covered=set(), now=205.0)  # b:1 removed; a:1 uncovered
    assert gone.alert.id == fired.alert.id and gone.alert.state is AlertState.RESOLVED
    assert named.alert.node == "dgx-01" and "dgx-01 is not being watched" in named.alert.summary
    assert after.learn([_health("a:1", up=True, node="dgx-01")]) == {}
    assert after.learn([_health("a:1", up=True, node="dgx-11")]) == {"a:1": "dgx-11"}


def test_a_cycle_with_nothing_usable_is_blind_with_its_reason_and_logged_once(caplog) -> None:
    agents = FakeAgents({"a:9471": "dgx-01", "b:9471": "dgx-02"})
    puller, now = make_puller(agents)
    agents.override = {t: httpx.Response(500) for t in agents.nodes}
    with caplog.at_level("WARNING"):
        run(puller.pull_once())
        run(puller.pull_once())
    assert puller.blind.reason == "all_targets_down" and puller.blind_cycles == {"all_targets_down": 2}
    assert len([r for r in caplog.records if r.getMessage().startswith("ingest is blind")]) == 1
    # Every snapshot refused: blind for that.
    agents.override = {}
    agents.buffers["a:9471"] = [{"node": "dgx-01", "time": 5.0, "gpus": "not a list"}]
    run(puller.pull_once())
    assert puller.blind.reason == "all_rejected"
    # One good sample: not blind.
    agents.buffers["b:9471"] = [snapshot("dgx-02", 6.0)]
    run(puller.pull_once())
    assert puller.blind is None
    assert puller.blind_cycles == {"all_targets_down": 2, "all_rejected": 1}


def test_no_target_listed_is_blind() -> None:
    puller, _ = make_puller(FakeAgents({}))
    run(puller.pull_once())
    assert puller.blind.reason == "no_targets"


def test_a_sample_far_behind_the_server_clock_is_rejected_as_too_old_and_not_asked_for_again() -> None:
    """A buffer kept from before an outage: the engine could not use it, and a fresh engine would start there."""
    agents = FakeAgents({"a:1": "n1"})
    puller, now = make_puller(agents, max_past_seconds=3600)
    now[0] = 100_000.0
    agents.buffers["a:1"] = [snapshot("n1", 1000.0), snapshot("n1", 100_000.0 - 3599), snapshot("n1", 99_995.0)]
    result = run(puller.pull_once())
    assert [s["time"] for s in result.samples] == [100_000.0 - 3599, 99_995.0] and result.rejected_snapshots == 1
    assert puller.errors[("a:1", "too_old")] == 1
    run(puller.pull_once())
    assert agents.requests[1] == ("a:1", "99995.0")
