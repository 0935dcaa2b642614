"""The puller: since-tracking, concurrency over targets, rejection of bad payloads, per-target health."""

from __future__ import annotations

import asyncio
import json

import httpx
import orjson

from server.ingest.puller import Puller
from server.ingest.targets import StaticTargets
from tests.server.live_fakes import envelope, parse_dict, snapshot


class FakeAgents:
    """A MockTransport handler serving /snapshots for several nodes from per-node buffers."""

    def __init__(self, nodes: dict[str, str]) -> None:
        self.nodes = nodes                      # target -> node name
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
    now = [1000.0]
    puller = Puller(StaticTargets(tuple(agents.nodes)), transport=httpx.MockTransport(agents.handler),
                    clock=lambda: now[0], parse=parse_dict, **kwargs)
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
    agents = FakeAgents({"good:1": "ok", "json:1": "x", "env:1": "x", "big:1": "x", "http:1": "x",
                         "down:1": "x", "slow:1": "x", "schema2:1": "x"})
    agents.buffers["good:1"] = [snapshot("ok", 1.0)]
    agents.override.update({
        "json:1": httpx.Response(200, content=b"{not json"),
        "env:1": httpx.Response(200, content=b'{"schema": 1, "snapshots": 7}'),
        "schema2:1": httpx.Response(200, content=b'{"schema": 2, "snapshots": []}'),
        "big:1": httpx.Response(200, content=b"[" + b" " * 5000 + b"]"),
        "http:1": httpx.Response(503, content=b'{"status": "stale"}'),
        "down:1": httpx.ConnectError("refused"),
        "slow:1": httpx.ReadTimeout("slow"),
    })
    puller, _ = make_puller(agents, max_payload_bytes=4096)
    result = run(puller.pull_once())
    assert [s["node"] for s in result.samples] == ["ok"]
    assert result.failed_targets == 7
    reasons = {target: reason for (target, reason) in puller.errors}
    assert reasons == {"json:1": "malformed_json", "env:1": "schema", "schema2:1": "schema", "big:1": "oversized",
                       "http:1": "http_status", "down:1": "connect", "slow:1": "timeout"}
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


def test_real_parser_rejects_contract_violations_when_available() -> None:
    """With the engine's own contract parser, a snapshot missing required fields is rejected, not raised."""
    import pytest

    contract = pytest.importorskip("server.contract", reason="engine contract module not written yet")
    agents = FakeAgents({"a:1": "n1"})
    good = snapshot("n1", 1.0)
    agents.buffers["a:1"] = [{"schema": 1, "node": "n1", "time": "soon"}, good]
    puller = Puller(StaticTargets(("a:1",)), transport=httpx.MockTransport(agents.handler),
                    parse=contract.parse_snapshot)
    result = run(puller.pull_once())
    assert result.rejected_snapshots == 1
    assert len(result.samples) == 1
    assert json.dumps(puller.errors[("a:1", "schema")]) == "1"
