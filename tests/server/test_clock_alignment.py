"""One clock-alignment rule: the same node clocks give the same alignment through replay and live ingest.

Each case is a cluster whose nodes sample the same instants of true time, each stamping its snapshots
with its own clock. Replay reads the lines as the agents recorded them; the live puller pulls fake agents
(an injected clock, a mock transport) that serve the same snapshots as they are taken. Both must put
every sample back at its true time, the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable

import httpx
import orjson
import pytest

from gpufleet.server import clocks
from gpufleet.server.clocks import ClockOffsets, Evidence, NodeTrace, offset_to_apply, stepped, trace_offsets
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.replay import aligned_samples, run_replay
from tests.server.engine_samples import T0, cluster_lines
from tests.server.live_fakes import envelope, parse_dict

SECONDS = 900.0
PULL_SECONDS = 5.0
NodeClock = Callable[[float], float]  # true time -> the node's clock


def _skewed(seconds: float) -> NodeClock:
    return lambda true: true + seconds


def _stepping(before: float, after: float, at: float) -> NodeClock:
    return lambda true: true + (after if true >= T0 + at else before)


# node -> its clock; nodes not named keep true time. `at`: when a step happens (None: no step).
CASES = {
    "a node 45 s ahead among good ones": ({"n1": _skewed(45.0)}, None),
    "a node 60 s behind among good ones": ({"n1": _skewed(-60.0)}, None),
    "a node 3 s off, left alone": ({"n1": _skewed(3.0)}, None),
    "a clock stepped 600 s ahead mid-run": ({"n1": _stepping(0.0, 600.0, 400.0)}, 400.0),
    "a clock stepped 597 s back mid-run": ({"n1": _stepping(0.0, -597.3, 400.0)}, 400.0),
    "a clock an hour behind, corrected by NTP mid-run": ({"n2": _stepping(-3600.0, 0.0, 300.0)}, 300.0),
    "two skewed nodes among three good ones": ({"n1": _skewed(-40.0), "n3": _skewed(90.0)}, None),
}


def _recorded(node_clocks: dict[str, NodeClock], nodes: int) -> list[dict]:
    """Every snapshot in the order taken, stamped in its node's clock; `_true` keeps its true time."""
    out = []
    for line in cluster_lines(SECONDS, nodes=nodes):
        snap = orjson.loads(line)
        true = snap["time"]
        snap["_true"] = true
        snap["time"] = node_clocks.get(snap["node"], lambda t: t)(true)
        out.append(snap)
    return out


def _replayed(snaps: list[dict]) -> dict[str, dict[float, float]]:
    """Per node: true time -> the time replay feeds the engine. Every sample's true time is its node's
    aligned rank: nodes sample every 5 s, and an alignment off by half of that fails below anyway."""
    by_node: dict[str, list[dict]] = {}
    for s in snaps:
        by_node.setdefault(s["node"], []).append(s)
    # One record file per node, as agents write them.
    sources = [
        (node, [orjson.dumps({k: v for k, v in s.items() if k != "_true"}) for s in ss]) for node, ss in by_node.items()
    ]
    aligned: dict[str, list[float]] = {}
    for sample in aligned_samples(sources):
        aligned.setdefault(sample.node, []).append(sample.time)
    out = {}
    for node, ss in by_node.items():
        trues = sorted(s["_true"] for s in ss)
        assert len(aligned[node]) == len(trues)
        out[node] = dict(zip(trues, sorted(aligned[node])))
    return out


class _Agents:
    """gpufleet agents for every node: each takes its snapshots at their true time, stamps them with its
    clock, buffers 300 s of them keyed by that clock (afresh when its clock goes back) and answers
    `since=` in its own clock, with its clock's time."""

    def __init__(self, snaps: list[dict], node_clocks: dict[str, NodeClock], now: list[float]) -> None:
        self.now, self.node_clocks = now, node_clocks
        self.pending: dict[str, list[dict]] = {}
        for s in snaps:
            self.pending.setdefault(s["node"], []).append(s)
        self.rings: dict[str, list[dict]] = {n: [] for n in self.pending}

    def clock(self, node: str, true: float) -> float:
        return self.node_clocks.get(node, lambda t: t)(true)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        node = f"n{int(request.url.host.rsplit('.', 1)[1]) - 1}"
        pending, ring = self.pending[node], self.rings[node]
        while pending and pending[0]["_true"] <= self.now[0]:
            snap = pending.pop(0)
            if ring and snap["time"] <= ring[-1]["time"]:
                ring.clear()
            ring.append(snap)
            ring[:] = [s for s in ring if s["time"] >= snap["time"] - 300]
        since = request.url.params.get("since")
        snaps = [s for s in ring if since is None or s["time"] > float(since)]
        body = {**envelope(node, snaps), "time": self.clock(node, self.now[0])}
        return httpx.Response(200, content=orjson.dumps(body))


def _pulled(snaps: list[dict], node_clocks: dict[str, NodeClock], nodes: int) -> dict[str, dict[float, float]]:
    """Per node: true time -> the time the live puller hands the engine."""
    now = [T0 + 2.0]
    puller = Puller(
        StaticTargets(tuple(f"10.0.0.{i + 1}:9471" for i in range(nodes))),
        transport=httpx.MockTransport(_Agents(snaps, node_clocks, now)),
        clock=lambda: now[0],
        parse=parse_dict,
    )
    out: dict[str, dict[float, float]] = {}

    async def pulls():
        while now[0] < T0 + SECONDS:
            for s in (await puller.pull_once()).samples:
                out.setdefault(s["node"], {})[s["_true"]] = s["time"]
            now[0] += PULL_SECONDS
        await puller.aclose()

    asyncio.run(pulls())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_node_clocks_are_lined_up_alike_by_replay_and_by_live_ingest(case):
    node_clocks, step_at = CASES[case]
    nodes = 5 if "two skewed" in case else 3
    snaps = _recorded(node_clocks, nodes)
    replayed, pulled = _replayed(snaps), _pulled(snaps, node_clocks, nodes)
    small = all(abs(c(T0) - T0) < clocks.MIN_OFFSET_SECONDS for c in node_clocks.values()) and step_at is None
    for node in replayed:
        # Replay puts every sample at its true time (or leaves a small offset in, as live does).
        for true, at in replayed[node].items():
            expected = node_clocks.get(node, lambda t: t)(true) if small else true
            assert at == pytest.approx(expected, abs=1.0), (node, true)
        # Live, the answer that brings a step also brings the samples taken just before it, stamped by
        # the old clock: those (a pull's worth) alone may land elsewhere.
        before_step = (lambda t: T0 + step_at - PULL_SECONDS <= t < T0 + step_at) if step_at is not None else None
        compared = [t for t in pulled[node] if before_step is None or not before_step(t)]
        assert len(compared) >= len(replayed[node]) - 3
        for true in compared:
            assert pulled[node][true] == pytest.approx(replayed[node][true], abs=1.0), (node, true)


@pytest.mark.parametrize("step", [600.0, -597.3])
def test_replay_of_a_clock_stepped_mid_run_fires_nothing(caplog, step):
    # Left as recorded, the stepped node's later samples sit 10 minutes from its peers': silent to them
    # for that long (unreachable), then alone.
    snaps = _recorded({"n1": _stepping(0.0, step, 400.0)}, 3)
    lines = [orjson.dumps({k: v for k, v in s.items() if k != "_true"}) for s in snaps]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay(lines) == []
    (stepped_note,) = [r for r in caplog.records if r.getMessage() == "node clock stepped"]
    assert stepped_note.node == "n1" and stepped_note.steps_seconds == [pytest.approx(step, abs=1.0)]
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.offset_seconds == pytest.approx(step, abs=1.0) and note.from_sample_time == pytest.approx(
        T0 + 400.0 + 0.1 + step
    )


# -- the rule -------------------------------------------------------------------------------------------


def test_the_rule_takes_out_offsets_beyond_the_minimum_and_the_slack_whose_measurements_agree():
    assert offset_to_apply(Evidence(12.0)) == 12.0
    assert offset_to_apply(Evidence(-9.0)) == 0.0  # under the minimum
    assert offset_to_apply(Evidence(-8.0), applied_seconds=-11.0) == -8.0  # kept down to half of it
    assert offset_to_apply(Evidence(-4.0), applied_seconds=-11.0) == 0.0
    assert offset_to_apply(Evidence(12.5), applied_seconds=12.0) == 12.0  # jitter does not move it
    assert offset_to_apply(Evidence(11.0, slack_seconds=10.0)) == 0.0  # within an interval and the slack
    assert offset_to_apply(Evidence(30.0, disagreement_seconds=10.0, slack_seconds=10.0)) == 0.0
    assert offset_to_apply(Evidence(30.0, disagreement_seconds=6.0, slack_seconds=10.0)) == 30.0
    assert offset_to_apply(Evidence(600.0), min_offset_seconds=0.0) == 0.0  # turned off
    assert stepped(0.0, 21.0) and stepped(5.0, -16.0) and not stepped(0.0, 20.0)


def test_a_gap_in_a_nodes_lines_is_an_outage_or_a_step_as_its_ends_say():
    # Three nodes agree on the trace's ends; n3 has a 300 s gap (interval 5 s, 120 samples).
    good = NodeTrace(0.0, 900.0, 181)
    outage = NodeTrace(0.0, 900.0, 121, (300.0,))
    step = NodeTrace(0.0, 1200.0, 181, (300.0,))
    back = NodeTrace(0.0, 300.0, 181, (-600.0,))
    nodes = {"n0": good, "n1": good, "n2": good}
    assert trace_offsets({**nodes, "n3": outage}) == {}
    assert trace_offsets({**nodes, "n3": step}) == {"n3": (0.0, 300.0)}
    assert trace_offsets({**nodes, "n3": back}) == {"n3": (0.0, -600.0)}
    # Two gaps, either of which could be the step: nothing says which, so the node is left alone.
    assert trace_offsets({**nodes, "n3": NodeTrace(0.0, 1200.0, 121, (300.0, 300.0))}) == {}


# -- malformed times --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_rule_and_its_estimators_never_crash_on_times_that_are_not_numbers(bad):
    assert offset_to_apply(Evidence(bad)) == 0.0
    assert offset_to_apply(Evidence(30.0, disagreement_seconds=bad), applied_seconds=30.0) == 30.0
    assert offset_to_apply(Evidence(30.0, slack_seconds=bad)) == 0.0
    assert not stepped(bad, bad)
    live = ClockOffsets()
    assert live.observe("a:1", T0 + 60.0, T0) == 60.0
    assert live.observe("a:1", bad, T0 + 5) == 60.0 and live.observe("a:1", T0 + 65.0, bad) == 60.0
    assert live.estimate("a:1") == 60.0
    good = NodeTrace(0.0, 900.0, 181)
    assert trace_offsets({"n0": good, "n1": good, "n2": good, "n3": NodeTrace(bad, bad, 181, (bad,))}) == {}
    clocks.jumps([0.0, 5.0, bad, 15.0, 20.0])


def test_replay_skips_malformed_times_and_still_lines_up_the_node_that_is_off(caplog):
    lines = [orjson.dumps({k: v for k, v in s.items() if k != "_true"}) for s in _recorded({"n1": _skewed(-60.0)}, 3)]
    broken = orjson.loads(lines[0])
    for bad in ("soon", None, True, -5.0, 1e300, [1.0], {"t": 1}):
        lines.insert(7, orjson.dumps({**broken, "time": bad}))
    lines.insert(9, orjson.dumps(broken).replace(str(broken["time"]).encode(), b"NaN"))
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay(lines) == []
    assert len([r for r in caplog.records if r.getMessage() == "skipping malformed line"]) == 8
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.node == "n1" and note.offset_seconds == pytest.approx(-60.0, abs=1.0)


def test_live_ingest_never_crashes_on_malformed_answer_or_sample_times():
    now = [T0 + 100.0]
    stamps = iter(["soon", None, True, -5.0, 1e300, [1.0], 0, "agent's clock"])

    def handler(request: httpx.Request) -> httpx.Response:
        good = {"schema": 1, "node": "n0", "time": now[0] + 60.0, "gpus": []}
        snaps = [good, {**good, "time": "late"}, {**good, "time": None}, {**good, "time": 1e300}, "x", 7]
        stamp = next(stamps)
        stamp = now[0] + 60.0 if stamp == "agent's clock" else stamp
        return httpx.Response(200, content=orjson.dumps({**envelope("n0", snaps), "time": stamp}))

    puller = Puller(
        StaticTargets(("10.0.0.1:9471",)),
        transport=httpx.MockTransport(handler),
        clock=lambda: now[0],
        parse=parse_dict,
    )

    async def pulls():
        got = []
        for _ in range(8):
            got.append(await puller.pull_once())
            now[0] += 5.0
        await puller.aclose()
        return got

    results = asyncio.run(pulls())
    assert all(r.failed_targets == 0 for r in results)
    # The agent's good sample comes out in the server's clock whatever its answer's stamp said.
    assert [[s["time"] for s in r.samples] for r in results] == [[T0 + 100.0 + 5.0 * i] for i in range(8)]
    assert puller.health()[0].clock_offset_seconds == pytest.approx(60.0)


@pytest.mark.parametrize("concatenated", [False, True])
def test_record_files_of_one_node_passed_in_any_order_are_not_read_as_a_clock_step(caplog, concatenated):
    # n1's record rotated at 450 s, its later file named first (or `cat` so into one stream): its lines
    # go back 450 s between the files, which is the order they were passed in, not its clock.
    snaps = _recorded({"n1": _skewed(-60.0)}, 3)
    line = {id(s): orjson.dumps({k: v for k, v in s.items() if k != "_true"}) for s in snaps}
    early = [line[id(s)] for s in snaps if s["node"] == "n1" and s["_true"] < T0 + 450]
    late = [line[id(s)] for s in snaps if s["node"] == "n1" and s["_true"] >= T0 + 450]
    others = [line[id(s)] for s in snaps if s["node"] != "n1"]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    sources = [("others", others), ("n1.1", late), ("n1.0", early)]
    samples = aligned_samples([("-", others + late + early)] if concatenated else sources)
    assert [s.time for s in samples if s.node == "n1"] == pytest.approx(
        [s["_true"] for s in snaps if s["node"] == "n1"], abs=1.0
    )
    assert not [r for r in caplog.records if r.getMessage() == "node clock stepped"]


def test_replay_tells_an_outage_of_a_node_whose_clock_is_off_from_a_clock_step(caplog):
    # n1 runs 60 s behind and its agent is down for two minutes mid-run: a gap in its lines, with both
    # of its ends 60 s off the others'. One offset for all of it; no step.
    lines = [
        orjson.dumps({k: v for k, v in s.items() if k != "_true"})
        for s in _recorded({"n1": _skewed(-60.0)}, 3)
        if not (s["node"] == "n1" and T0 + 300 <= s["_true"] < T0 + 420)
    ]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    alerts = run_replay(lines)
    assert [(a.kind.value, a.node) for a in alerts] == [("node_unreachable", "n1")]
    assert T0 + 300 <= alerts[0].started <= T0 + 360
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.node == "n1" and note.offset_seconds == pytest.approx(-60.0, abs=1.0)
    assert not [r for r in caplog.records if r.getMessage() == "node clock stepped"]
