"""Agent clocks that run off the server's: measured from when answers arrive, and taken out of sample times."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from gpufleet.server.alerts import AlertKind
from gpufleet.server.clocks import ClockOffsets
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings, load_settings
from gpufleet.server.store import AlertQuery
from tests.server.engine_samples import T0, cluster_lines
from tests.server.live_fakes import envelope, parse_dict, snapshot


def test_an_agreeing_clock_is_left_alone_whatever_the_delays():
    clocks = ClockOffsets()
    # Stamps trail arrival by a sample's age and the transfer: 0.2-9 s here, never ahead.
    for i, delay in enumerate((0.3, 9.0, 4.0, 0.2, 7.5)):
        assert clocks.observe("a:1", 1000.0 + 5 * i - delay, 1000.0 + 5 * i) == 0.0
    assert clocks.estimate("a:1") == pytest.approx(-0.2)


@pytest.mark.parametrize("offset", [-60.0, 45.0, -12.0])
def test_an_offset_is_measured_from_the_least_delayed_answer(offset):
    clocks = ClockOffsets()
    taken = [
        clocks.observe("a:1", 1000.0 + 5 * i + offset - delay, 1000.0 + 5 * i)
        for i, delay in enumerate((3.0, 0.4, 8.0, 0.5))
    ]
    # The first answer already shows it (less its 3 s delay); the second, less delayed, refines it.
    assert taken[0] == pytest.approx(offset - 3.0)
    assert taken[1:] == [pytest.approx(offset - 0.4)] * 3


def test_jitter_does_not_move_the_offset_and_a_corrected_clock_is_trusted_again(caplog):
    caplog.set_level(logging.INFO, logger="gpufleet.server.clocks")
    clocks = ClockOffsets()
    t = 1000.0
    for delay in (0.1, 1.5, 0.9, 1.9):
        assert clocks.observe("a:1", t + 30.0 - delay, t, "n1") == pytest.approx(29.9)
        t += 5
    # The clock was slewed back by less than a step: the old answers stand in the window until a minute of
    # new ones pushed them out.
    applied = []
    for _ in range(12):
        applied.append(clocks.observe("a:1", t + 14.0, t, "n1"))
        t += 5
    assert applied[:11] == [pytest.approx(29.9)] * 11 and applied[11] == 14.0
    assert clocks.observe("a:1", t + 30.0, t, "n1") == 30.0  # and a step forward of 16 s: at once
    t += 5
    # NTP stepped it back to ours: learned from the first answer after the step.
    assert clocks.observe("a:1", t - 0.5, t, "n1") == 0.0
    assert [r.getMessage() for r in caplog.records] == [
        "agent clock offset taken out",
        "agent clock offset taken out",
        "agent clock offset taken out",
        "agent clock stepped",
        "agent clock agrees again",
    ]
    assert caplog.records[0].offset_seconds == 29.9 and caplog.records[0].node == "n1"
    assert caplog.records[3].step_seconds == -30.5
    # A clock that ran behind shows itself corrected at once: the new answers are the least delayed.
    assert clocks.observe("a:2", t - 40.0, t) == -40.0 and clocks.observe("a:2", t + 4.5, t + 5) == 0.0


@pytest.mark.parametrize("step", [-600.0, -3600.0, 600.0])
def test_a_clock_step_either_way_is_taken_out_from_the_first_answer_after_it(step):
    clocks = ClockOffsets()
    t = 1000.0
    for _ in range(5):
        assert clocks.observe("a:1", t - 0.5, t) == 0.0
        t += 5
    assert clocks.observe("a:1", t + step - 0.5, t) == step - 0.5
    assert clocks.observe("a:1", t + 5 + step - 0.3, t + 5) == step - 0.5  # then jitter, as before


def test_an_offset_near_the_threshold_does_not_flap():
    # A clock behind and creeping back: each answer is the least delayed yet, so the estimate is the newest.
    clocks = ClockOffsets(min_offset_seconds=10.0)
    got = [
        clocks.observe("a:1", 1000.0 + 5 * i + offset, 1000.0 + 5 * i)
        for i, offset in enumerate((-11.0, -9.0, -8.0, -6.0, -4.0))
    ]
    # Taken out at 10 s, kept down to 5 s; moved only by more than 2 s.
    assert got == [-11.0, -11.0, -8.0, -8.0, 0.0]
    assert ClockOffsets(min_offset_seconds=10.0).observe("a:1", 991.0, 1000.0) == 0.0


def test_zero_turns_the_correction_off_but_still_measures():
    clocks = ClockOffsets(min_offset_seconds=0.0)
    assert clocks.observe("a:1", 940.0, 1000.0) == 0.0
    assert clocks.estimate("a:1") == -60.0 and clocks.offset("a:1") == 0.0
    with pytest.raises(ValueError):
        ClockOffsets(min_offset_seconds=-1.0)


def test_the_flag_sets_the_threshold_and_zero_means_never():
    assert load_settings([]).pull_clock_offset_min_seconds == 10.0
    assert load_settings(["--pull.clock-offset-min", "30s"]).pull_clock_offset_min_seconds == 30.0
    assert load_settings(["--pull.clock-offset-min", "0"]).pull_clock_offset_min_seconds == 0.0


# -- through the puller -----------------------------------------------------------------------------


def _agent(now: list[float], offset: float, *, stamped: bool = True):
    """One agent whose clock reads `offset` seconds off the server's: a snapshot a second, 300 s buffered."""
    requests = []

    def handler(request: httpx.Request) -> httpx.Response:
        since = request.url.params.get("since")
        requests.append(since)
        agent_now = now[0] + offset
        snaps = [
            snapshot("n1", t)
            for t in range(int(agent_now) - 300, int(agent_now) + 1)
            if since is None or t > float(since)
        ]
        body = envelope("n1", snaps)
        if stamped:
            body["time"] = agent_now
        return httpx.Response(200, content=orjson.dumps(body))

    return handler, requests


@pytest.mark.parametrize("stamped", [True, False])
def test_samples_of_a_node_behind_come_out_in_the_server_clock_while_since_stays_in_the_agent_clock(stamped):
    now = [10_000.0]
    handler, requests = _agent(now, -60.0, stamped=stamped)
    puller = Puller(
        StaticTargets(("10.0.0.1:9471",)),
        transport=httpx.MockTransport(handler),
        clock=lambda: now[0],
        parse=parse_dict,
    )

    async def pulls():
        out = []
        for _ in range(3):
            out.append(await puller.pull_once())
            now[0] += 5
        await puller.aclose()
        return out

    first, second, third = asyncio.run(pulls())
    assert [s["time"] for s in first.samples][-1] == 10_000.0  # the newest, taken just now
    assert [s["time"] for s in second.samples] == [10_001.0 + i for i in range(5)]
    assert requests == [None, repr(9940.0), repr(9945.0)]  # what the agent's buffer is keyed by
    (health,) = puller.health()
    assert health.clock_offset_seconds == -60.0 and health.last_sample_time == 9950.0


def test_a_nonsense_answer_time_falls_back_to_the_newest_sample():
    now = [10_000.0]
    handler, _ = _agent(now, 0.0)

    def broken(request):
        response = handler(request)
        body = orjson.loads(response.content)
        body["time"] = 0.0  # milliseconds, a zero, a typo: not an agent clock
        return httpx.Response(200, content=orjson.dumps(body))

    puller = Puller(
        StaticTargets(("10.0.0.1:9471",)), transport=httpx.MockTransport(broken), clock=lambda: now[0], parse=parse_dict
    )
    result = asyncio.run(puller.pull_once())
    assert result.samples[-1]["time"] == 10_000.0 and puller.health()[0].clock_offset_seconds == 0.0


# -- the live pipeline with the real engine -----------------------------------------------------------


def _cluster_agents(now: list[float], skew: dict[str, float], seconds: float):
    """Three nodes' agents serving cluster_lines as they are taken: by the true time, stamped in each node's
    own clock (true time + its skew)."""
    by_node: dict[str, list[dict]] = {}
    for line in cluster_lines(seconds, nodes=3):
        snap = orjson.loads(line)
        snap["time"] += skew.get(snap["node"], 0.0)
        by_node.setdefault(snap["node"], []).append(snap)

    def handler(request: httpx.Request) -> httpx.Response:
        node = f"n{int(request.url.host.rsplit('.', 1)[1]) - 1}"
        since = request.url.params.get("since")
        off = skew.get(node, 0.0)
        snaps = [s for s in by_node[node] if s["time"] - off <= now[0] and (since is None or s["time"] > float(since))]
        return httpx.Response(200, content=orjson.dumps({**envelope(node, snaps), "time": now[0] + off}))

    return handler


@pytest.mark.parametrize("skew", [-60.0, 45.0])
@pytest.mark.parametrize("correct", [True, False])
def test_a_node_with_its_clock_off_stays_in_the_comparisons_of_the_live_server(tmp_path, skew, correct):
    now = [T0 + 2.0]
    seconds = 900.0
    handler = _cluster_agents(now, {"n1": skew}, seconds)
    settings = ServerSettings(
        targets=tuple(f"10.0.0.{i + 1}:9471" for i in range(3)),
        storage_path=str(tmp_path / "c.db"),
        pull_clock_offset_min_seconds=10.0 if correct else 0.0,
    )
    runtime = build_runtime(settings, clock=lambda: now[0], transport=httpx.MockTransport(handler))

    async def cycles():
        while now[0] < T0 + seconds - 5:
            now[0] += 5
            await runtime.cycle()
        await runtime.source.aclose()

    asyncio.run(cycles())
    alerts = [(a.kind.value, a.node) for a in runtime.store.open_alerts()]
    nodes = {n["node"]: n for n in runtime.view.nodes}
    runtime.store.close()
    if correct:
        assert alerts == []
        # Its newest sample trails the evaluation like its peers', not by the skew.
        assert abs(nodes["n1"]["last_sample_time"] - nodes["n0"]["last_sample_time"]) < 1.0
    elif skew < 0:
        # Left alone, the node behind delivers every sample after its bin was judged: unreachable, always.
        assert ("node_unreachable", "n1") in alerts
    else:
        assert abs(nodes["n1"]["last_sample_time"] - nodes["n0"]["last_sample_time"] - skew) < 1.0


# -- clock steps on a live agent ----------------------------------------------------------------------


class _SteppingAgents:
    """gpufleet agents for n0..n2 sampling every 5 s of true time; n1's clock steps by `step` seconds at
    true time `at`. Like the real agent, each buffers 300 s of snapshots keyed by its own clock, starts the
    buffer afresh when its clock goes back, and answers `since=` in its own clock with its clock's time."""

    def __init__(self, now: list[float], step: float, at: float) -> None:
        self.now, self.step, self.at = now, step, at
        self.lines = {}
        for line in cluster_lines(900, nodes=3):
            snap = orjson.loads(line)
            self.lines.setdefault(snap["node"], []).append(snap)
        self.rings: dict[str, list[dict]] = {n: [] for n in self.lines}
        self.taken = {n: 0 for n in self.lines}

    def clock(self, node: str, true: float) -> float:
        return true + (self.step if node == "n1" and true >= self.at else 0.0)

    def _sample(self, node: str) -> None:
        snaps, ring = self.lines[node], self.rings[node]
        while self.taken[node] < len(snaps) and snaps[self.taken[node]]["time"] <= self.now[0]:
            snap = dict(snaps[self.taken[node]])
            snap["time"] = self.clock(node, snap["time"])
            self.taken[node] += 1
            if ring and snap["time"] <= ring[-1]["time"]:
                ring.clear()
            ring.append(snap)
            ring[:] = [s for s in ring if s["time"] >= snap["time"] - 300]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        node = f"n{int(request.url.host.rsplit('.', 1)[1]) - 1}"
        self._sample(node)
        since = request.url.params.get("since")
        snaps = [s for s in self.rings[node] if since is None or s["time"] > float(since)]
        body = {**envelope(node, snaps), "time": self.clock(node, self.now[0])}
        return httpx.Response(200, content=orjson.dumps(body))


@pytest.mark.parametrize("step", [-600.0, -3600.0, 600.0, 3600.0])
def test_an_agent_whose_clock_steps_is_never_dark_and_its_samples_stay_in_step(tmp_path, step):
    now = [T0 + 2.0]
    agents = _SteppingAgents(now, step, at=T0 + 400.0)
    settings = ServerSettings(
        targets=tuple(f"10.0.0.{i + 1}:9471" for i in range(3)), storage_path=str(tmp_path / "c.db")
    )
    runtime = build_runtime(settings, clock=lambda: now[0], transport=httpx.MockTransport(agents))
    gaps = []

    async def cycles():
        while now[0] < T0 + 895:
            now[0] += 5
            await runtime.cycle()
            nodes = {n["node"]: n for n in runtime.view.nodes}
            if "n1" in nodes and nodes["n1"]["last_sample_time"] is not None:
                gaps.append(nodes["n0"]["last_sample_time"] - nodes["n1"]["last_sample_time"])
        await runtime.source.aclose()

    asyncio.run(cycles())
    alerts = [(a.kind.value, a.node) for a in runtime.store.open_alerts()]
    history = runtime.store.query(AlertQuery(kind=AlertKind.NODE_UNREACHABLE))
    health = {h.node: h for h in runtime.source.health()}
    stats = runtime.view.stats
    runtime.store.close()
    assert alerts == [] and history.total == 0
    # At most the pull that saw the step went by without n1's samples: its newest trails n0's by a pull or
    # two, never by the step.
    assert max(gaps) <= 10.5
    assert health["n1"].up and not health["n1"].stale
    assert health["n1"].clock_offset_seconds == pytest.approx(step, abs=5.0)
    assert stats["too_old_snapshots_dropped"] == 0 or step > 0
    assert runtime.source.errors_by_reason().get("future_time", 0) == 0
