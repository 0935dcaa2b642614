"""What one agent's answer may cost the server: values, snapshots, GPUs and bytes are bounded before
decoding, decoding runs off the event loop, first pulls ask for a span, too-big answers shrink the next
ask, and a target answers for one node only."""

from __future__ import annotations

import asyncio
import threading

import httpx
import orjson

from gpufleet.server.ingest import puller as puller_module
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from tests.server.live_fakes import envelope, parse_dict, snapshot


class RingAgents:
    """Agents with a ring of one snapshot per second up to `newest`, honouring `since` and `span` as
    gpufleet agents do; `nodes` says which node name each target answers with."""

    def __init__(self, nodes: dict[str, str], newest: float = 1000.0, ring_seconds: int = 300, gpus: int = 2) -> None:
        self.nodes = nodes
        self.newest = newest
        self.ring_seconds = ring_seconds
        self.gpus = gpus
        self.requests: list[tuple[str, str | None, str | None]] = []
        self.body: dict[str, bytes] = {}  # a fixed answer for a target

    def ring(self, target: str) -> list[dict]:
        node = self.nodes[target]
        return [
            snapshot(node, self.newest - age, temps=(60.0,) * self.gpus) for age in range(self.ring_seconds - 1, -1, -1)
        ]

    def answer(self, request: httpx.Request) -> bytes:
        target = f"{request.url.host}:{request.url.port}"
        since, span = request.url.params.get("since"), request.url.params.get("span")
        self.requests.append((target, since, span))
        if target in self.body:
            return self.body[target]
        floor = max(float(since) if since else -1.0, self.newest - float(span) if span else -1.0)
        return orjson.dumps(
            {
                **envelope(self.nodes[target], [s for s in self.ring(target) if s["time"] > floor]),
                "time": self.newest + 0.5,
            }
        )

    def handler(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=self.answer(request))


def make(agents: RingAgents, **kwargs) -> Puller:
    kwargs.setdefault("clock_offset_min_seconds", 0.0)
    kwargs.setdefault("parse", parse_dict)
    return Puller(
        StaticTargets(tuple(agents.nodes)),
        transport=httpx.MockTransport(agents.handler),
        clock=lambda: 1001.0,
        **kwargs,
    )


def cycles(puller: Puller, n: int) -> list:
    async def go():
        out = [await puller.pull_once() for _ in range(n)]
        await puller.aclose()
        return out

    return asyncio.run(go())


def up(puller: Puller) -> dict[str, bool]:
    return {h.target: h.up for h in puller.health()}


# --- bounded before decoding, and decoded off the event loop ------------------------------------------------


def test_millions_of_tiny_entries_are_refused_before_any_decoding(monkeypatch) -> None:
    # 2 M empty GPU entries in 4 MB: decoded, each would be a Python object (gigabytes in all).
    agents = RingAgents({"a:1": "n1", "b:1": "n2"})
    agents.body["a:1"] = (
        b'{"schema":1,"node":"n1","snapshots":[{"node":"n1","time":1000,"gpus":['
        + b",".join([b"{}"] * 2_000_000)
        + b"]}]}"
    )
    loads = []
    real_loads = orjson.loads
    monkeypatch.setattr(puller_module.orjson, "loads", lambda body: loads.append(len(body)) or real_loads(body))
    puller = make(agents, max_payload_bytes=8 * 1024 * 1024)
    result = cycles(puller, 1)[0]
    assert puller.errors == {("a:1", "too_many_entries"): 1}
    assert up(puller) == {"a:1": False, "b:1": True}
    assert {s["node"] for s in result.samples} == {"n2"}
    assert len(loads) == 1  # only b's answer was decoded


def test_too_many_snapshots_in_an_answer_are_refused_and_the_target_is_not_up() -> None:
    agents = RingAgents({"a:1": "n1"}, ring_seconds=10)
    puller = make(agents, max_snapshots=5)
    assert cycles(puller, 1)[0].samples == []
    assert puller.errors == {("a:1", "too_many_snapshots"): 1} and up(puller) == {"a:1": False}


def test_a_snapshot_with_more_gpus_than_allowed_is_rejected_alone() -> None:
    agents = RingAgents({"a:1": "n1"}, ring_seconds=2, gpus=3)
    agents.body["a:1"] = orjson.dumps(
        envelope("n1", [snapshot("n1", 999.0, temps=(60.0,) * 5), snapshot("n1", 1000.0, temps=(60.0,) * 3)])
    )
    puller = make(agents, max_gpus=4)
    result = cycles(puller, 1)[0]
    assert [s["time"] for s in result.samples] == [1000.0] and result.rejected_snapshots == 1
    assert puller.errors == {("a:1", "too_many_gpus"): 1} and up(puller) == {"a:1": True}


def test_decoding_and_validation_run_off_the_event_loop() -> None:
    agents = RingAgents({"a:1": "n1"}, ring_seconds=3)
    threads: list[int] = []

    def parse(raw):
        threads.append(threading.get_ident())
        return parse_dict(raw)

    puller = make(agents, parse=parse)
    loop_thread = []

    async def go():
        loop_thread.append(threading.get_ident())
        result = await puller.pull_once()
        await puller.aclose()
        return result

    assert len(asyncio.run(go()).samples) == 3
    assert len(threads) == 3 and loop_thread[0] not in threads


# --- first pulls, and answers too big to take ---------------------------------------------------------------


def test_a_first_pull_asks_for_the_engines_span_not_the_whole_ring() -> None:
    agents = RingAgents({"a:1": "n1"})
    puller = make(agents, first_span_seconds=120.0)
    first, second = cycles(puller, 2)
    assert agents.requests[0] == ("a:1", None, "120.0")
    assert len(first.samples) == 120 and min(s["time"] for s in first.samples) == 881.0
    assert agents.requests[1] == ("a:1", "1000.0", None)  # then only what is new
    assert second.samples == []


def test_many_first_pulls_in_one_cycle_share_a_budget_of_seconds() -> None:
    # A restart into a large fleet: every target's first pull in the same cycle, and every sample of the
    # cycle held until the engine takes them.
    agents = RingAgents({f"10.0.0.{i}:9471": f"n{i}" for i in range(10)}, ring_seconds=200, gpus=1)
    puller = make(agents, first_span_seconds=120.0, first_budget_seconds=300.0)
    first = cycles(puller, 1)[0]
    assert {span for _, _, span in agents.requests} == {"30.0"} and len(first.samples) == 300

    agents = RingAgents({"a:1": "n1"}, ring_seconds=200, gpus=1)
    puller = make(agents, first_span_seconds=120.0, first_budget_seconds=300.0)
    assert len(cycles(puller, 1)[0].samples) == 120 and agents.requests[0][2] == "120.0"  # alone: the whole span


def test_first_pulls_are_read_a_few_at_a_time_and_later_pulls_all_at_once() -> None:
    targets = {f"10.0.0.{i}:9471": f"n{i}" for i in range(12)}
    agents = RingAgents(targets, ring_seconds=3)
    reading = [0, 0]  # now, most at once

    class Body(httpx.AsyncByteStream):
        def __init__(self, data: bytes) -> None:
            self.data = data

        async def __aiter__(self):
            reading[0] += 1
            reading[1] = max(reading)
            for _ in range(3):
                await asyncio.sleep(0)  # hand the loop to the other pulls mid-body
            yield self.data
            reading[0] -= 1

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Body(agents.answer(request)))

    puller = Puller(
        StaticTargets(tuple(targets)),
        transport=httpx.MockTransport(handler),
        clock=lambda: 1001.0,
        parse=parse_dict,
        clock_offset_min_seconds=0.0,
        first_concurrency=3,
    )

    async def go():
        first = await puller.pull_once()
        most_first, reading[1] = reading[1], 0
        agents.newest += 1
        await puller.pull_once()
        await puller.aclose()
        return first, most_first, reading[1]

    first, most_first, most_later = asyncio.run(go())
    assert len(first.samples) == 36 and first.failed_targets == 0
    assert most_first == 3 and most_later == 12


def test_an_oversized_answer_shrinks_the_next_ask_until_it_fits() -> None:
    # A ring sampled fast enough to exceed max-bytes: asking for it again would fail forever.
    agents = RingAgents({"a:1": "n1"}, gpus=8)
    one = len(orjson.dumps(snapshot("n1", 1000.0, temps=(60.0,) * 8)))
    puller = make(agents, first_span_seconds=120.0, max_payload_bytes=40 * one)
    results = cycles(puller, 4)
    assert [span for _, _, span in agents.requests] == ["120.0", "60.0", "30.0", None]
    assert [len(r.samples) for r in results] == [0, 0, 30, 0]
    assert puller.errors == {("a:1", "oversized"): 2} and up(puller) == {"a:1": True}
    # Once the agent's clock is known (its answers' stamps), a shortened ask also says `since`, which agents
    # without `span` keep to.
    assert agents.requests[3][1] == "1000.0"


def test_too_many_entries_shrink_the_next_ask_too() -> None:
    agents = RingAgents({"a:1": "n1"}, gpus=2)
    per_snapshot = len(orjson.dumps(snapshot("n1", 1000.0, temps=(60.0, 60.0))).split(b","))
    puller = make(agents, first_span_seconds=100.0, max_entries=70 * per_snapshot)
    results = cycles(puller, 2)
    assert [span for _, _, span in agents.requests] == ["100.0", "50.0"]
    assert len(results[1].samples) == 50 and puller.errors == {("a:1", "too_many_entries"): 1}


# --- identity -----------------------------------------------------------------------------------------------


def test_a_target_cannot_answer_for_another_targets_node() -> None:
    agents = RingAgents({"a:1": "hgx-01", "b:1": "hgx-01"}, ring_seconds=2)
    puller = make(agents)
    result = cycles(puller, 1)[0]
    assert {s["node"] for s in result.samples} == {"hgx-01"} and len(result.samples) == 2
    assert puller.errors == {("b:1", "node_claimed"): 1}
    assert up(puller) == {"a:1": True, "b:1": False}


def test_a_target_keeps_the_node_it_was_first_seen_as() -> None:
    agents = RingAgents({"a:1": "hgx-01"}, ring_seconds=2)
    puller = make(agents)

    async def go():
        first = await puller.pull_once()
        agents.nodes["a:1"] = "hgx-02"  # the same address now says it is another node
        agents.newest += 5
        second = await puller.pull_once()
        await puller.aclose()
        return first, second

    first, second = asyncio.run(go())
    assert len(first.samples) == 2 and second.samples == []
    assert puller.errors == {("a:1", "node_changed"): 1} and up(puller) == {"a:1": False}


def test_a_snapshot_naming_another_node_is_rejected_alone() -> None:
    agents = RingAgents({"a:1": "hgx-01"})
    agents.body["a:1"] = orjson.dumps(envelope("hgx-01", [snapshot("hgx-01", 999.0), snapshot("hgx-07", 1000.0)]))
    puller = make(agents)
    result = cycles(puller, 1)[0]
    assert [s["node"] for s in result.samples] == ["hgx-01"] and result.rejected_snapshots == 1
    assert puller.errors == {("a:1", "node_mismatch"): 1}


def test_nodes_and_gpus_per_node_are_bounded_and_freed_when_a_target_leaves() -> None:
    listed = ["a:1", "b:1", "c:1"]

    class Listed:
        def targets(self) -> list[str]:
            return list(listed)

    agents = RingAgents({"a:1": "n1", "b:1": "n2", "c:1": "n3"}, ring_seconds=1)
    puller = Puller(
        Listed(),
        transport=httpx.MockTransport(agents.handler),
        clock=lambda: 1001.0,
        parse=parse_dict,
        clock_offset_min_seconds=0.0,
        max_nodes=2,
    )

    async def go():
        first = await puller.pull_once()
        listed.remove("a:1")
        agents.newest += 1
        second = await puller.pull_once()
        await puller.aclose()
        return first, second

    first, second = asyncio.run(go())
    assert {s["node"] for s in first.samples} == {"n1", "n2"}
    assert {s["node"] for s in second.samples} == {"n2", "n3"}  # n1's place went to n3
    assert puller.errors == {("c:1", "too_many_nodes"): 1}

    # GPU indices per node: a node showing new ones on every answer stops at max_gpus.
    agents = RingAgents({"a:1": "n1"}, ring_seconds=1)
    rotating = [{**snapshot("n1", 990.0 + k, temps=(60.0, 60.0))} for k in range(4)]
    for k, snap in enumerate(rotating):
        snap["gpus"] = [{**g, "index": 2 * k + g["index"]} for g in snap["gpus"]]
    agents.body["a:1"] = orjson.dumps(envelope("n1", rotating))
    puller = make(agents, max_gpus=5)
    result = cycles(puller, 1)[0]
    assert [s["time"] for s in result.samples] == [990.0, 991.0] and result.rejected_snapshots == 2
    assert puller.errors == {("a:1", "too_many_gpus"): 2}


# --- /metrics reads the counts from another thread ----------------------------------------------------------


def test_error_counts_read_by_metrics_do_not_change_under_the_reader() -> None:
    agents = RingAgents({"a:1": "n1", "b:1": "n2", "c:1": "n3"}, ring_seconds=1)
    agents.body = {"a:1": b"{bad", "b:1": b"{bad"}
    puller = make(agents)

    async def go():
        await puller.pull_once()
        counts = puller.errors
        reading = iter(counts.items())
        next(reading)  # a /metrics scrape half-way through the dict ...
        agents.body["c:1"] = b"[]"  # ... while the loop counts a new (target, reason)
        await puller.pull_once()
        rest = list(reading)  # a live dict would raise "changed size during iteration"
        await puller.aclose()
        return counts, rest

    counts, rest = asyncio.run(go())
    assert len(rest) == 1 and dict(counts) == {("a:1", "malformed_json"): 1, ("b:1", "malformed_json"): 1}
    assert puller.errors[("c:1", "schema")] == 1 and puller.errors_by_reason()["malformed_json"] == 4


# --- settings -----------------------------------------------------------------------------------------------


def test_the_limits_are_settings_and_reach_the_puller(tmp_path) -> None:
    import dataclasses

    import pytest

    from gpufleet.server.serve import build_source
    from gpufleet.server.settings import ConfigError, load_settings

    settings = load_settings(
        [
            "--targets",
            "a:1",
            "--pull.max-snapshots",
            "100",
            "--pull.max-gpus",
            "16",
            "--pull.max-nodes",
            "50",
            "--pull.max-entries",
            "5000",
            "--pull.first-concurrency",
            "2",
            "--storage.path",
            str(tmp_path / "s.db"),
        ],
        env={},
    )
    settings = dataclasses.replace(settings, engine={"min_history_seconds": 200})
    puller = build_source(settings)
    assert (puller.max_snapshots, puller.max_gpus, puller.max_nodes, puller.max_entries) == (100, 16, 50, 5000)
    assert puller.first_span_seconds == 200.0
    with pytest.raises(ConfigError, match="pull.max-gpus"):
        load_settings(["--pull.max-gpus", "300"], env={})
    with pytest.raises(ConfigError, match="pull.max-nodes"):
        load_settings(["--pull.max-nodes", "0"], env={})
