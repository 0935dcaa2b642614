"""`--shard.jobless fleet`: every shard reads every GPU of no job (its own and, as guests, the others'), so its
engine infers jobs as one server does, and publishes only its own part: each alert by exactly one shard, the
shard it belonged to when it opened; nodes and counts without the guests; the database asked for every node
and host with a GPU of no job; the setting a flag, a file key and an environment variable."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx
import orjson
import pytest

from gpufleet.server.alerts import Alert, AlertKind, Transition
from gpufleet.server.cli import main as cli
from gpufleet.server.engine.views import EngineStats, NodeHealth
from gpufleet.server.history import Charts, FleetCell
from gpufleet.server.ingest.owned import NodePart, Ownership, ShardedSource, owned_part
from gpufleet.server.ingest.prometheus import PrometheusSource
from gpufleet.server.published import Publication, PublishedEngine, published_alerts, publishes
from gpufleet.server.replay import run_samples
from gpufleet.server.settings import ConfigError, load_settings
from gpufleet.server.shard import Shard, shard_of
from tests.server.live_fakes import make_alert
from gpufleet.server.ingest.base import TargetHealth
from tests.server.test_sharding import (
    JOBS,
    NODES,
    Database,
    Listed,
    _lost_gpu_run,
    agent_series,
    dcgm_series,
    snapshot,
)


def fleet(index: int, count: int) -> Shard:
    return Shard(index, count, "fleet")


def test_a_fleet_shard_reads_every_gpu_of_no_job_and_marks_the_ones_not_its_own_as_guests() -> None:
    jobs = [JOBS[0], JOBS[1], None, JOBS[2], None, JOBS[1]]
    sample = snapshot(NODES[0], jobs)
    jobless = {i for i, job in enumerate(jobs) if job is None}
    for count in (2, 3, 4):
        published = Counter[int]()
        for index in range(count):
            ownership = Ownership(fleet(index, count))
            part = ownership.part(sample)
            by_node = owned_part(sample, Shard(index, count))  # what the shard owns, as in `node`
            own = set(by_node.indices) if by_node is not None else set()
            assert part is not None and set(part.indices) == own | jobless
            noted = ownership.parts[NODES[0]]
            assert noted.guests == frozenset(jobless - own) and noted.own == bool(own)
            published.update(jobless - noted.guests)
        assert published == Counter({i: 1 for i in jobless})  # each GPU of no job is one shard's own
    node_mode = Ownership(Shard(0, 2))
    expected = owned_part(sample, Shard(0, 2))
    assert expected is not None and node_mode.part(sample).uuids == expected.uuids and node_mode.parts == {}
    assert Ownership(fleet(0, 1)).part(sample) is sample  # unsharded: nothing to mark


def test_each_alert_is_published_by_exactly_one_shard() -> None:
    count = 3
    node = NODES[1]
    # Two jobs of one shard on the node, so that the other two read its GPUs of no job as guests only.
    first = JOBS[3]
    second = next(j for j in JOBS[4:] if shard_of(j, count) == shard_of(first, count))
    sample = snapshot(node, [first, None, None, second])
    parts = []
    for index in range(count):
        ownership = Ownership(fleet(index, count))
        ownership.part(sample)
        parts.append(ownership.parts[node])
    alerts = [
        make_alert(1, node=node, gpu=0, hpc_job=first),
        make_alert(2, kind=AlertKind.THERMAL_THROTTLE, node=node, gpu=1, hpc_job=None),
        make_alert(3, node=node, gpu=2, hpc_job=None),
        make_alert(4, kind=AlertKind.NODE_UNREACHABLE, node=node, gpu=None, hpc_job=None),
        make_alert(5, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job=second),
        make_alert(6, node="never-read", gpu=0, hpc_job=None),
        make_alert(7, kind=AlertKind.GPU_LOST, node=node, gpu=9, hpc_job=None),  # gone from the node's sample
    ]
    owner = shard_of(first, count)
    for alert in alerts:
        by = [i for i in range(count) if publishes(alert, fleet(i, count), parts[i] if alert.node == node else None)]
        assert by == [shard_of("never-read", count) if alert.node == "never-read" else owner], alert.id
    # Every shard read the job-less GPUs, and the two others as guests.
    assert [p.own for p in parts] == [i == owner for i in range(count)]
    assert all(p.guests == (frozenset() if i == owner else frozenset({1, 2})) for i, p in enumerate(parts))


def _fleet_replay(samples: list[Any], shard: Shard) -> tuple[list[Alert], list[Alert]]:
    """One shard's replay as replay_db does it: (every alert its engine raised, the ones it publishes)."""
    ownership = Ownership(shard)
    parts, handovers, timeline = [], [], {}
    read = False
    for sample in samples:
        part = ownership.part(sample)
        if part is None and read:
            handovers.append((sample.time, sample.node))
        read = part is not None
        if part is not None:
            parts.append(part)
        noted = ownership.parts[sample.node]
        seen = timeline.setdefault(sample.node, [])
        if not seen or (seen[-1].guests, seen[-1].own) != (noted.guests, noted.own):
            seen.append(noted)
    raised = run_samples(parts, handovers=handovers)
    return raised, published_alerts(raised, shard, timeline)


def test_a_lost_gpu_is_published_once_with_its_jobs_name_though_every_shard_reads_it() -> None:
    second = JOBS[0]
    theirs = 1 - shard_of(second, 2)
    first = next(j for j in JOBS if shard_of(j, 2) == theirs)
    node = next(n for n in NODES if shard_of(n, 2) == theirs)
    samples = _lost_gpu_run(node, first, second)

    def keys(alerts: list[Alert]) -> list[tuple[Any, ...]]:
        return sorted((a.kind.value, a.node, a.gpu, a.hpc_job, a.started) for a in alerts)

    whole = run_samples(samples)
    assert [(a.gpu, a.hpc_job) for a in whole if a.kind.value == "gpu_lost"] == [(4, second)]
    runs = [_fleet_replay(samples, fleet(i, 2)) for i in range(2)]
    assert keys([a for _, published in runs for a in published]) == keys(whole)
    # The node's shard by name read the lost GPU as a guest once its label went, and its engine raised it
    # again without a job: what the filter keeps from being published twice.
    raised_there = [(a.gpu, a.hpc_job) for a in runs[theirs][0] if a.kind.value == "gpu_lost"]
    assert (4, None) in raised_there


@dataclass
class Engine:
    """An engine whose transitions, alerts and nodes a test sets."""

    transitions: list[Transition] = field(default_factory=list)
    open: list[Alert] = field(default_factory=list)
    node_health: list[NodeHealth] = field(default_factory=list)
    restored: list[Alert] = field(default_factory=list)

    def ingest(self, sample: Any) -> None:
        pass

    def advance(self, now: float) -> list[Transition]:
        return self.transitions

    def forget_node(self, node: str, t: float, reason: str) -> list[Transition]:
        return [t for t in self.transitions if t.alert.node == node]

    def restore(self, alerts: list[Alert]) -> int:
        self.restored = list(alerts)
        return len(alerts)

    def alerts(self) -> list[Alert]:
        return self.open

    def jobs(self) -> list[Any]:
        return []

    def nodes(self) -> list[NodeHealth]:
        return self.node_health

    def stats(self) -> EngineStats:
        n = len(self.open)
        return EngineStats(
            samples_ingested=0,
            late_samples_dropped=0,
            too_old_snapshots_dropped=0,
            pending_samples=0,
            ticks=1,
            last_tick_time=1000.0,
            gpus=6,
            nodes=2,
            jobs=1,
            open_alerts=n,
            firing_alerts=n,
            gpus_unjudged=3,
        )


def node_health(node: str, gpus: int, unjudged: int = 0) -> NodeHealth:
    return NodeHealth(
        node=node,
        gpus=gpus,
        reachable=True,
        last_sample_time=1000.0,
        lag_seconds=0.0,
        hpc_jobs=(),
        open_alerts=9,
        unjudged_gpus=unjudged,
    )


def test_a_fleet_shard_shows_its_own_part_and_an_alert_stays_with_the_shard_it_opened_on() -> None:
    shard = fleet(0, 2)
    mine = next(j for j in JOBS if shard.owns_job(j))
    theirs = next(j for j in JOBS if not shard.owns_job(j))
    parts = {"n": NodePart(1000.0, frozenset({1, 2, 3}), True), "guest": NodePart(1000.0, frozenset({0, 1}), False)}
    engine = Engine(node_health=[node_health("n", 4, unjudged=2), node_health("guest", 2, unjudged=1)])
    shown = PublishedEngine(engine, Publication(shard, lambda: parts))
    own_gpu = make_alert(1, node="n", gpu=0, hpc_job=None)
    guest_gpu = make_alert(2, node="n", gpu=1, hpc_job=None)
    guest_node = make_alert(3, kind=AlertKind.NODE_UNREACHABLE, node="guest", gpu=None, hpc_job=None)
    own_job = make_alert(4, node="guest", gpu=5, hpc_job=mine)
    their_job = make_alert(5, node="n", gpu=0, hpc_job=theirs)
    everything = [own_gpu, guest_gpu, guest_node, own_job, their_job]
    engine.transitions = [Transition(a, None) for a in everything]
    engine.open = list(everything)
    assert [t.alert for t in shown.advance(1000.0)] == [own_gpu, own_job]
    assert shown.alerts() == [own_gpu, own_job]
    assert [t.alert for t in shown.forget_node("n", 1000.0, "gone")] == [own_gpu]
    # GPU 0 becomes a guest and GPU 1 the shard's own (a job started beside them on another shard's node):
    # the open alerts stay where they opened, a new one about GPU 1 is published here.
    parts["n"] = NodePart(1005.0, frozenset({0, 2, 3}), True)
    new_gpu1 = make_alert(6, node="n", gpu=1, hpc_job=None)
    engine.open = [*everything, new_gpu1]
    assert shown.alerts() == [own_gpu, own_job, new_gpu1]
    assert [(n.node, n.gpus, n.open_alerts, n.unjudged_gpus) for n in shown.nodes()] == [("n", 1, 2, 2)]
    stats = shown.stats()
    assert (stats.gpus, stats.nodes, stats.open_alerts, stats.firing_alerts, stats.gpus_unjudged) == (1, 1, 3, 3, 2)
    # Resolved alerts' decisions are forgotten; alerts restored from the store stay this shard's.
    engine.transitions, engine.open = [], []
    shown.advance(1010.0)
    restored = make_alert(7, node="guest", gpu=0, hpc_job=None)
    assert shown.restore([restored]) == 1 and engine.restored == [restored]
    engine.open = [restored]
    assert shown.alerts() == [restored]
    assert shown.jobs() == [] and shown.restored == [restored]  # anything else is the engine's own
    # The status page's fleet cells: per GPU, the guests left out; per node, the nodes of guests alone.
    cells = [FleetCell(node, gpu, 1, None, 60.0, 1.0) for node, gpu in (("n", 0), ("n", 1), ("guest", 0), ("x", 0))]
    per_gpu = shown.published_charts(Charts(fleet=tuple(cells)))
    assert [(c.node, c.gpu) for c in per_gpu.fleet] == [("n", 1), ("x", 0)]
    per_node = [FleetCell(node, None, 4, None, 60.0, 1.0) for node in ("n", "guest", "x")]
    assert [c.node for c in shown.published_charts(Charts(fleet=tuple(per_node), fleet_per_node=True)).fleet] == [
        "n",
        "x",
    ]


def test_a_fleet_shard_reads_its_guests_without_speaking_for_their_nodes() -> None:
    shard = fleet(0, 2)
    guest = next(n for n in NODES if not shard.owns_node(n))
    own = next(n for n in NODES if shard.owns_node(n))
    foreign = next(j for j in JOBS if not shard.owns_job(j))
    inner = Listed()
    source = ShardedSource(inner, shard)  # type: ignore[arg-type]
    inner.targets = [
        TargetHealth(target="10.0.0.1:9471", node=guest, up=True),
        TargetHealth(target="10.0.0.2:9471", node=own, up=True),
    ]
    inner.samples = [snapshot(guest, [None, None]), snapshot(own, [None])]
    first = asyncio.run(source.pull_once())
    assert sorted(s.node for s in first.samples) == sorted([guest, own]) and first.handed_over == ()
    assert [h.node for h in source.health()] == [own]  # its agent's alerts and /nodes rows are another shard's
    assert source.parts[guest].guests == frozenset({0, 1}) and not source.parts[guest].own
    # Half the guest node to another shard's job: its job-less GPU is still read; all of it: handed over.
    inner.samples = [snapshot(guest, [foreign, None], 1001.0)]
    second = asyncio.run(source.pull_once())
    assert [s.indices for s in second.samples] == [(1,)] and second.handed_over == ()
    inner.samples = [snapshot(guest, [foreign, foreign], 1002.0)]
    assert asyncio.run(source.pull_once()).handed_over == (guest,)


class JoblessDatabase(Database):
    """Database, answering also the instant query for the nodes with a GPU of no job."""

    def handler(self, request: httpx.Request) -> httpx.Response:
        query = parse_qs(request.url.query.decode()).get("query", [""])[0]
        if not query.startswith("group by (node)"):
            return super().handler(request)
        self.requests.append((request.url.path, {"query": [query]}))
        named = {(s["metric"]["node"], s["metric"]["uuid"]) for s in self.series if _is(s, "gpufleet_gpu_job_info")}
        sampled = {(s["metric"]["node"], s["metric"]["uuid"]) for s in self.series if _is(s, "gpufleet_gpu_up")}
        nodes = sorted({node for node, uuid in sampled - named})
        result = [{"metric": {"node": n}, "value": [0, "1"]} for n in nodes]
        return httpx.Response(200, content=orjson.dumps({"status": "success", "data": {"result": result}}))


def _is(series: dict, name: str) -> bool:
    return bool(series["metric"]["__name__"] == name)


def up_series(node: str, t: float) -> dict:
    labels = {"node": node, "gpu": "0", "uuid": f"GPU-{node}", "instance": f"{node}:9471", "job": "gpufleet-agent"}
    return {"metric": {**labels, "__name__": "gpufleet_gpu_up"}, "values": [[t, "1"]]}


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_fleet_shard_asks_the_database_for_every_node_and_host_with_a_gpu_of_no_job(index: int) -> None:
    shard = fleet(index, 3)
    t = 1000.0
    series = [
        *(s for i in range(12) for s in agent_series(NODES[i], JOBS[i] if i < 9 else None, t)),
        *(up_series(NODES[i], t) for i in range(12)),
        *(dcgm_series(f"dcgm-{i}", JOBS[20 + i] if i < 9 else None, t) for i in range(12)),
    ]
    db = JoblessDatabase(series)
    source = PrometheusSource(
        "http://vm:8428", transport=httpx.MockTransport(db.handler), clock=lambda: t + 1, shard=shard
    )
    result = asyncio.run(source.pull_once())
    asyncio.run(source.aclose())
    queries = [p["query"][0] for path, p in db.requests if path == "/api/v1/query"]
    asked: dict[str, set[str]] = {"node": set(), "Hostname": set()}
    for query in queries:
        for label, quoted in re.findall(r'(\w+)=~("(?:[^"\\]|\\.)*")', query):
            if label in asked:
                asked[label] |= {re.sub(r"\\(.)", r"\1", v) for v in orjson.loads(quoted).split("|")}
    by_node = {n for i, n in enumerate(NODES[:12]) if i < 9 and shard.owns_job(JOBS[i])}
    by_node |= {n for n in NODES[:12] if shard.owns_node(n)}
    # Every job-less node, whichever shard its name hashes to; another shard's job's node only by its name.
    assert asked["node"] == by_node | set(NODES[9:12])
    assert asked["Hostname"] == {f"dcgm-{i}" for i in range(9, 12)}
    read = {s.node for s in result.samples}
    assert set(NODES[9:12]) | {f"dcgm-{i}" for i in range(9, 12)} <= read


def test_shard_jobless_is_a_flag_a_file_key_and_an_environment_variable(tmp_path) -> None:
    assert load_settings(["--shard", "1/4"], env={}).shard == Shard(1, 4, "node")
    assert load_settings(["--shard", "1/4", "--shard.jobless", "fleet"], env={}).shard == fleet(1, 4)
    assert load_settings(["--shard", "1/4"], env={"GPUFLEET_SERVER_SHARD_JOBLESS": "fleet"}).shard == fleet(1, 4)
    config = tmp_path / "server.yml"
    config.write_text("shard: 2/8\nshard.jobless: fleet\n")
    assert load_settings(["--config.file", str(config)], env={}).shard == fleet(2, 8)


def test_a_bad_shard_jobless_is_a_one_line_error_and_exit_2(tmp_path, capsys) -> None:
    for bad in ("everywhere", "", "Fleet"):
        with pytest.raises(ConfigError, match="shard.jobless"):
            load_settings(["--shard", "1/4", "--shard.jobless", bad], env={})
        assert cli(["check-config", "--targets", "a:9471", "--shard", "1/4", "--shard.jobless", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "shard.jobless" in err and "node, fleet" in err
    with pytest.raises(ValueError, match="node or fleet"):
        Shard(0, 2, "all")
    storage = ["--storage.path", str(tmp_path / "s.db")]
    assert cli(["check-config", "--targets", "a:9471", "--shard", "1/4", "--shard.jobless", "fleet", *storage]) == 0
    assert "shard 1/4 with 0 peer URL(s), every GPU of no job read" in capsys.readouterr().out


def test_only_a_fleet_shards_engine_is_shown_through_its_publication(tmp_path) -> None:
    from gpufleet.server.serve import build_runtime

    for flags, wrapped in (
        (["--shard", "1/4", "--shard.jobless", "fleet"], True),
        (["--shard", "1/4"], False),
        (["--shard.jobless", "fleet"], False),  # unsharded: its own part is everything
    ):
        settings = load_settings(["--targets", "a:9471", "--storage.path", str(tmp_path / "s.db"), *flags], env={})
        runtime = build_runtime(settings)
        assert isinstance(runtime.engine, PublishedEngine) is wrapped, flags
        runtime.store.close()
        asyncio.run(runtime.source.aclose())


def test_the_shard_replay_flag_reads_the_mode() -> None:
    import argparse

    from gpufleet.server import replay_db

    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="*")
    replay_db.add_arguments(parser)
    argv = ["--prometheus-url", "http://vm:8428", "--start", "0", "--end", "10", "--shard", "1/2"]
    assert replay_db.checked(parser.parse_args([*argv, "--shard.jobless", "fleet"])).shard == fleet(1, 2)
    assert replay_db.checked(parser.parse_args(argv)).shard == Shard(1, 2)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([*argv, "--shard.jobless", "all"])
    assert exited.value.code == 2


def test_a_guest_node_gone_silent_is_forgotten_past_the_grace_as_an_own_one_is(tmp_path) -> None:
    from gpufleet.server.runtime import REMOVED_REASON, Runtime
    from gpufleet.server.store import AlertStore

    shard = fleet(0, 2)
    guest = next(n for n in NODES if not shard.owns_node(n))
    inner = Listed()
    source = ShardedSource(inner, shard)  # type: ignore[arg-type]
    inner.samples = [snapshot(guest, [None, None], 1000.0)]
    engine = Engine(node_health=[node_health(guest, 2)])  # its last sample at 1000 s
    forgotten: list[tuple[str, str]] = []
    engine.forget_node = lambda node, t, reason: forgotten.append((node, reason)) or []  # type: ignore[method-assign]
    now = [1000.0]
    runtime = Runtime(
        engine=PublishedEngine(engine, Publication(shard, lambda: source.parts)),
        source=source,  # type: ignore[arg-type]
        store=AlertStore(str(tmp_path / "s.db")),
        clock=lambda: now[0],
        shard=shard,
        removed_grace_seconds=300.0,
    )
    for t in (1000.0, 1200.0, 1400.0):
        now[0] = t
        asyncio.run(runtime.cycle())
        inner.samples = []
    assert forgotten == [] and runtime.view.nodes == ()  # not shown, still read
    now[0] = 1700.0
    asyncio.run(runtime.cycle())
    assert forgotten == [(guest, REMOVED_REASON)]
    runtime.store.close()
