"""A shard's part of the fleet (`--shard`): samples cut to the owned GPUs, health kept for the owned nodes, nodes
handed over to another shard forgotten, the database asked for the owned series only, and the fleet view
put together from the peers, naming the shards that did not answer."""

from __future__ import annotations

import asyncio
import re
from typing import Any
from urllib.parse import parse_qs

import httpx
import orjson
import pytest

from gpufleet.server.api.models import JobModel, JobsModel, ShardModel
from gpufleet.server.api.peers import Peers
from gpufleet.server.cli import main as cli
from gpufleet.server.contract import parse_snapshot
from gpufleet.server.ingest.base import PullResult, TargetHealth
from gpufleet.server.ingest.owned import Ownership, ShardedSource, owned_part
from gpufleet.server.ingest.prometheus import PrometheusSource
from gpufleet.server.settings import ConfigError, load_settings
from gpufleet.server.shard import Shard, shard_of

JOBS = [f"job-{i}" for i in range(40)]
NODES = [f"node-{i:02d}" for i in range(40)]


def snapshot(node: str, jobs: list[str | None], t: float = 1000.0) -> Any:
    gpus = [
        {"index": i, "uuid": f"GPU-{node}-{i}", "model": "H100", "hpc_job": job, "temperature_celsius": 60.0 + i}
        for i, job in enumerate(jobs)
    ]
    return parse_snapshot({"schema": 1, "node": node, "time": t, "gpus": gpus})


def test_every_gpu_of_a_mixed_node_goes_to_exactly_one_shard() -> None:
    jobs = [JOBS[0], JOBS[1], None, JOBS[2], JOBS[1]]
    sample = snapshot(NODES[0], jobs)
    parts = [owned_part(sample, Shard(i, 4)) for i in range(4)]
    owners = {}
    for index, part in enumerate(parts):
        for row, uuid in enumerate(part.uuids if part is not None else ()):
            assert uuid not in owners
            owners[uuid] = index
            assert part.value(part.indices[row], "temperature_celsius") == sample.value(
                sample.indices[sample.uuids.index(uuid)], "temperature_celsius"
            )
    assert set(owners) == set(sample.uuids)
    host_job = min(j for j in jobs if j)  # a job-less GPU goes with its node's job (the least of them)
    for uuid, job in zip(sample.uuids, jobs):
        assert Shard(owners[uuid], 4).owns(job or host_job, NODES[0])
    assert owned_part(sample, Shard(0, 1)) is sample


class Listed:
    """An inner source answering the samples and health it is given."""

    def __init__(self) -> None:
        self.samples: list[Any] = []
        self.targets: list[TargetHealth] = []
        stale_after_seconds = 30.0
        self.stale_after_seconds = stale_after_seconds

    async def pull_once(self) -> PullResult:
        return PullResult(self.samples, 0.0, 0.0, len(self.targets), 0, 0)

    def health(self) -> list[TargetHealth]:
        return self.targets

    def remember_identities(self, nodes: Any, pins: Any = None) -> None:
        pass


def test_a_node_whose_gpus_go_to_another_shards_job_is_handed_over_and_its_health_with_it() -> None:
    shard = Shard(0, 2)
    node = next(n for n in NODES if shard.owns_node(n))
    foreign = next(j for j in JOBS if not shard.owns_job(j))
    inner = Listed()
    source = ShardedSource(inner, shard)  # type: ignore[arg-type]
    inner.targets = [
        TargetHealth(target="10.0.0.1:9471", node=node, up=True),
        TargetHealth(target="10.0.0.2:9471", node=None, up=False),
    ]
    inner.samples = [snapshot(node, [None, None])]
    first = asyncio.run(source.pull_once())
    assert [s.node for s in first.samples] == [node] and first.handed_over == ()
    assert [h.target for h in source.health()] == ["10.0.0.1:9471"] + (
        ["10.0.0.2:9471"] if shard.owns_node("10.0.0.2:9471") else []
    )
    inner.samples = [snapshot(node, [None, None], 1000.0), snapshot(node, [foreign, foreign], 1001.0)]
    second = asyncio.run(source.pull_once())
    assert [s.time for s in second.samples] == [1000.0] and second.handed_over == (node,)
    assert node not in {h.node for h in source.health()}
    inner.samples = [snapshot(node, [foreign, foreign], 1002.0)]
    assert asyncio.run(source.pull_once()).handed_over == ()


class Database:
    """A Prometheus query API over fixed series, recording every request: label values and range selectors."""

    def __init__(self, series: list[dict]) -> None:
        self.series = series
        self.requests: list[tuple[str, dict[str, list[str]]]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        params = parse_qs(request.url.query.decode())
        self.requests.append((request.url.path, params))
        if request.url.path.startswith("/api/v1/label/"):
            label = request.url.path.split("/")[4]
            selected = [s for s in self.series if self._matches(s["metric"], params["match[]"][0])]
            data = sorted({s["metric"][label] for s in selected if s["metric"].get(label)})
            return httpx.Response(200, content=orjson.dumps({"status": "success", "data": data}))
        query = params["query"][0]
        if query.startswith("up{"):
            return httpx.Response(200, content=orjson.dumps({"status": "success", "data": {"result": []}}))
        selector = re.fullmatch(r"(.*)\[\d+s\]", query)
        assert selector, query
        result = [s for s in self.series if self._matches(s["metric"], selector.group(1))]
        return httpx.Response(200, content=orjson.dumps({"status": "success", "data": {"result": result}}))

    @staticmethod
    def _matches(labels: dict[str, str], selector: str) -> bool:
        name, _, rest = selector.partition("{")
        matchers = re.findall(r'(\w+)(=~|=)("(?:[^"\\]|\\.)*")', rest)
        if name and labels["__name__"] != name:
            return False
        for label, op, quoted in matchers:
            value, wanted = labels.get(label, ""), orjson.loads(quoted)
            if not (re.fullmatch(wanted, value) if op == "=~" else value == wanted):
                return False
        return True


def agent_series(node: str, job: str | None, t: float) -> list[dict]:
    base = {"node": node, "gpu": "0", "uuid": f"GPU-{node}", "instance": f"{node}:9471", "job": "gpufleet-agent"}
    out = [
        {"metric": {**base, "__name__": "gpufleet_gpu_temperature_celsius"}, "values": [[t, "61"]]},
        {
            "metric": {"__name__": "gpufleet_agent_sample_age_seconds", "node": node, "instance": f"{node}:9471"},
            "values": [[t, "0.1"]],
        },
    ]
    if job:
        out.append({"metric": {**base, "__name__": "gpufleet_gpu_job_info", "hpc_job": job}, "values": [[t, "1"]]})
    return out


def dcgm_series(host: str, job: str | None, t: float, **pod: str) -> dict:
    labels = {"__name__": "DCGM_FI_DEV_GPU_TEMP", "Hostname": host, "gpu": "0", "UUID": f"GPU-{host}", **pod}
    return {"metric": {**labels, **({"hpc_job": job} if job else {})}, "values": [[t, "62"]]}


# dcgm-exporter with Kubernetes pod mapping and no hpc_job: host -> (namespace, pod), and the job that names.
PODS = {
    "k8s-0": ("ml", "train-worker-0", "ml/train"),
    "k8s-1": ("ml", "train-worker-1", "ml/train"),
    "k8s-2": ("ml", "eval-x7k2p", "ml/eval"),
    "k8s-3": ("research", "llama-master-0", "research/llama"),
    "k8s-4": ("research", "llama-worker-0", "research/llama"),
    "k8s-5": ("prod", "serve-0", "prod/serve"),
}


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_shard_asks_the_database_for_its_own_jobs_and_nodes_only(index: int) -> None:
    shard = Shard(index, 3)
    t = 1000.0
    fleet = [
        *(s for i in range(12) for s in agent_series(NODES[i], JOBS[i] if i < 9 else None, t)),
        *(dcgm_series(f"dcgm-{i}", JOBS[20 + i] if i < 9 else None, t) for i in range(12)),
        *(dcgm_series(host, None, t, namespace=ns, pod=pod) for host, (ns, pod, _) in PODS.items()),
    ]
    db = Database(fleet)
    source = PrometheusSource(
        "http://vm:8428", transport=httpx.MockTransport(db.handler), clock=lambda: t + 1, shard=shard
    )
    result = asyncio.run(source.pull_once())
    asyncio.run(source.aclose())
    owned_nodes = {n for i, n in enumerate(NODES[:12]) if (shard.owns_job(JOBS[i]) if i < 9 else shard.owns_node(n))}
    owned_hosts = {
        f"dcgm-{i}" for i in range(12) if (shard.owns_job(JOBS[20 + i]) if i < 9 else shard.owns_node(f"dcgm-{i}"))
    } | {host for host, (_, _, job) in PODS.items() if shard.owns_job(job)}
    # Read: the owned jobs' nodes and the nodes that hash here (for their GPUs of no job), whose GPUs of other
    # shards' jobs the filter downstream cuts off.
    assert {s.node for s in result.samples} == owned_nodes | owned_hosts | {n for n in NODES[:12] if shard.owns_node(n)}
    assert {s.node for s in result.samples if owned_part(s, shard) is not None} == owned_nodes | owned_hosts
    # No series of another shard's job, job-less node or job-less host was asked for: only this one's, by name.
    queries = [p["query"][0] for path, p in db.requests if path == "/api/v1/query"]
    asked: dict[str, set[str]] = {"hpc_job": set(), "node": set(), "Hostname": set(), "pod": set()}
    for query in queries:
        for label, quoted in re.findall(r'(\w+)=~("(?:[^"\\]|\\.)*")', query):
            if label in asked:
                asked[label] |= {re.sub(r"\\(.)", r"\1", v) for v in orjson.loads(quoted).split("|")}
    assert asked["hpc_job"] == {j for i, j in enumerate(JOBS) if (i < 9 or 20 <= i < 29) and shard.owns_job(j)}
    assert asked["node"] == {n for i, n in enumerate(NODES[:12]) if i < 9 and shard.owns_job(JOBS[i])} | {
        n for n in NODES[:12] if shard.owns_node(n)
    }
    assert asked["Hostname"] == {f"dcgm-{i}" for i in range(9, 12) if shard.owns_node(f"dcgm-{i}")}
    assert asked["pod"] == {pod for _, pod, job in PODS.values() if shard.owns_job(job)}
    jobs = {s.node: set(s.jobs) for s in result.samples}
    assert all(jobs[host] == {job} for host, (_, _, job) in PODS.items() if host in jobs)


def test_a_shard_that_owns_nothing_of_a_listed_fleet_is_not_blind() -> None:
    t = 1000.0
    job = next(j for j in JOBS if not Shard(0, 2).owns_job(j))
    db = Database(agent_series("n", job, t))
    source = PrometheusSource(
        "http://vm:8428",
        transport=httpx.MockTransport(db.handler),
        clock=lambda: t + 1,
        parse=lambda raw: raw,
        shard=Shard(0, 2),
    )
    node_owned = Shard(0, 2).owns_node("n")
    result = asyncio.run(source.pull_once())
    assert source.blind is None
    # The node hashes here, so its series are read (for GPUs of no job): the filter downstream drops them.
    assert len(result.samples) == int(node_owned)


def jobs_answer(index: int, count: int, jobs: list[str]) -> bytes:
    model = JobsModel(
        jobs=[JobModel(hpc_job=j, gpus=8) for j in jobs], evaluated_at=1.0, shard=ShardModel(index=index, count=count)
    )
    return model.model_dump_json().encode()


def test_the_fleet_view_joins_the_peers_parts_and_names_the_shards_that_did_not_answer() -> None:
    answers = {
        "10.0.0.1": (200, jobs_answer(1, 4, ["b"])),
        "10.0.0.2": (200, jobs_answer(1, 4, ["b-replica"])),  # the HA twin of shard 1: one answer per shard kept
        "10.0.0.3": (500, b"oops"),
        "other": (200, jobs_answer(0, 3, ["x"])),  # a server of another sharding: refused
    }
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.host, request.url.params["scope"]))
        status, body = answers[request.url.host]
        return httpx.Response(status, content=body)

    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("gpufleet-shards", 9472)
        return ["10.0.0.1", "10.0.0.2", "10.0.0.3"]

    peers = Peers(
        ["dns+http://gpufleet-shards:9472", "http://other:9472"],
        Shard(2, 4),
        transport=httpx.MockTransport(handler),
        resolve=resolve,
    )
    own = JobsModel(jobs=[JobModel(hpc_job="a", gpus=8)], evaluated_at=2.0, shard=ShardModel(index=2, count=4))

    def merge(parts: list[JobsModel]) -> JobsModel:
        return JobsModel(jobs=[j for p in parts for j in p.jobs], evaluated_at=None)

    view = asyncio.run(peers.fleet(own, "/jobs", {}, JobsModel, merge))
    assert [j.hpc_job for j in view.jobs] == ["b", "a"]
    assert view.scope == "fleet" and view.shard == ShardModel(index=2, count=4)
    assert view.shards_missing == [0, 3]
    assert {e.peer: e.error for e in view.peer_errors} == {
        "http://10.0.0.3:9472": "HTTP 500",
        "http://other:9472": "is shard 0/3, not of 4",
    }
    assert {scope for _, scope in asked} == {"shard"}  # a peer answers its own part: no recursion


def test_a_bad_shard_is_a_one_line_error_and_exit_2(tmp_path, capsys) -> None:
    for bad in ("2/2", "1", "-1/4", "a/b"):
        with pytest.raises(ConfigError, match="--shard"):
            load_settings(["--shard", bad])
        assert cli(["check-config", "--ingest.prometheus-url", "http://vm:8428", "--shard", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "shard" in err
    config = tmp_path / "server.yml"
    config.write_text("shard: 3/16\nshard.peers: [http://a:9472, 'dns+http://shards:9472']\n")
    settings = load_settings(["--config.file", str(config), "--ingest.prometheus-url", "http://vm:8428"])
    assert (settings.shard, settings.shard_peers) == (Shard(3, 16), ("http://a:9472", "dns+http://shards:9472"))
    storage = str(tmp_path / "s.db")
    assert (
        cli(
            [
                "check-config",
                "--config.file",
                str(config),
                "--ingest.prometheus-url",
                "http://vm:8428",
                "--storage.path",
                storage,
            ]
        )
        == 0
    )
    assert "shard 3/16" in capsys.readouterr().out


def shard_app(tmp_path, index: int, alerts: list) -> Any:
    from fastapi.testclient import TestClient

    from gpufleet.server.api import create_app
    from gpufleet.server.ingest.puller import Puller
    from gpufleet.server.ingest.targets import StaticTargets
    from gpufleet.server.runtime import Runtime
    from gpufleet.server.settings import ServerSettings
    from gpufleet.server.store import AlertStore
    from tests.server.live_fakes import StubEngine, parse_dict

    shard = Shard(index, 2)
    settings = ServerSettings(storage_path=str(tmp_path / f"shard{index}.db"), shard=shard)
    empty = httpx.MockTransport(lambda r: httpx.Response(200, content=b'{"schema":1,"snapshots":[]}'))
    puller = Puller(StaticTargets(("a:1",)), transport=empty, parse=parse_dict, clock=lambda: 5000.0)
    runtime = Runtime(
        engine=StubEngine(), source=puller, store=AlertStore(settings.storage_path), clock=lambda: 5000.0, shard=shard
    )
    runtime.store.upsert(alerts)
    app = create_app(settings, runtime=runtime, run_pipeline=False)
    return app, TestClient(app)


def test_any_shard_shows_the_fleets_alerts_and_page_and_says_which_shard_is_missing(tmp_path) -> None:
    from tests.server.live_fakes import make_alert

    app0, client0 = shard_app(tmp_path, 0, [make_alert(i, node=f"a{i}", hpc_job="j0") for i in (1, 4, 5)])
    app1, client1 = shard_app(tmp_path, 1, [make_alert(i, node=f"b{i}", hpc_job="j1") for i in (2, 3)])
    app0.state.peers = Peers(["http://shard-1:9472"], Shard(0, 2), transport=httpx.ASGITransport(app=app1))

    own = client0.get("/alerts").json()
    assert own["shard"] == {"index": 0, "count": 2} and own["scope"] == "shard" and own["total"] == 3
    fleet = client0.get("/alerts", params={"scope": "fleet", "limit": 2, "offset": 1}).json()
    assert [a["summary"] for a in fleet["alerts"]] == ["alert 4", "alert 3"]  # newest first over both shards
    assert (fleet["total"], fleet["next_offset"], fleet["shards_missing"]) == (5, 3, [])
    assert client1.get("/alerts", params={"scope": "fleet"}).json()["total"] == 2  # no peers: its own part
    metrics = client1.get("/metrics").text
    assert 'gpufleet_server_shard_info{count="2",index="1"} 1.0' in metrics
    assert "Shard <b>0/2</b>" in client0.get("/").text

    app0.state.peers = Peers(
        ["http://shard-1:9472"], Shard(0, 2), transport=httpx.MockTransport(lambda r: httpx.Response(503))
    )
    page = client0.get("/", params={"scope": "fleet"}).text
    assert "Not shown: shard 1 did not answer." in page and "http://shard-1:9472: HTTP 503" in page
    jobs = client0.get("/jobs", params={"scope": "fleet"}).json()
    assert jobs["shards_missing"] == [1] and jobs["peer_errors"] == [
        {"peer": "http://shard-1:9472", "error": "HTTP 503"}
    ]


def test_a_sharded_server_that_pulls_the_agents_judges_its_own_part() -> None:
    from gpufleet.server.serve import build_source

    settings = load_settings(["--targets", "a:9471", "--shard", "1/4"])
    source = build_source(settings)
    assert isinstance(source, ShardedSource) and source.shard == Shard(1, 4)
    assert not isinstance(build_source(load_settings(["--targets", "a:9471"])), ShardedSource)
    asyncio.run(source.aclose())


def test_a_restart_into_another_part_resolves_the_stored_alerts_that_are_no_longer_its_own(tmp_path) -> None:
    from gpufleet.server.alerts import AlertState
    from gpufleet.server.runtime import Runtime
    from gpufleet.server.store import AlertQuery, AlertStore
    from tests.server.live_fakes import StubEngine, make_alert

    shard = Shard(1, 2)
    mine = next(j for j in JOBS if shard.owns_job(j))
    theirs = next(j for j in JOBS if not shard.owns_job(j))
    store = AlertStore(str(tmp_path / "s.db"))
    store.upsert([make_alert(1, hpc_job=mine), make_alert(2, hpc_job=theirs), make_alert(3, node=None, hpc_job=theirs)])
    engine = StubEngine()
    runtime = Runtime(engine=engine, source=Listed(), store=store, clock=lambda: 5000.0, shard=shard)  # type: ignore[arg-type]
    assert runtime.restore() == 1
    assert [a.hpc_job for a in store.open_alerts()] == [mine]
    assert [a.hpc_job for a in engine.restored] == [mine]
    resolved = store.query(AlertQuery(state=AlertState.RESOLVED)).alerts
    assert sorted(a.id for a in resolved) == sorted(
        make_alert(n, hpc_job=theirs, node=node).id for n, node in ((2, "dgx-01"), (3, None))
    )
    assert {a.evidence["resolved_reason"] for a in resolved} == {"its jobs belong to another shard"}


def test_any_shard_shows_the_fleets_nodes_and_incidents_and_says_which_shard_is_missing(tmp_path) -> None:
    from dataclasses import replace

    from gpufleet.server.alerts import IncidentRole
    from gpufleet.server.runtime import FleetView
    from tests.server.live_fakes import make_alert

    def node(name: str, gpus: int, jobs: list[str], reachable: bool = True, t: float = 4990.0) -> dict:
        return {
            "node": name,
            "gpus": gpus,
            "reachable": reachable,
            "last_sample_time": t,
            "lag_seconds": 5000.0 - t,
            "hpc_jobs": jobs,
            "open_alerts": 1,
        }

    def incident(n: int, node_: str, job: str) -> tuple:
        cause = make_alert(n, node=node_, hpc_job=job)
        cause = replace(cause, incident=cause.id, role=IncidentRole.CAUSE)
        effect = replace(make_alert(n + 100, node=node_, hpc_job=job), incident=cause.id, role=IncidentRole.EFFECT)
        return cause, effect

    app0, client0 = shard_app(tmp_path, 0, [])
    app1, client1 = shard_app(tmp_path, 1, [])
    # `shared` runs a GPU of a job of each shard: each shard sees its own GPU of it.
    app0.state.runtime.view = FleetView(
        alerts=(*incident(1, "a1", "j0"), *incident(3, "shared", "j0")),
        nodes=(node("a1", 8, ["j0"]), node("shared", 1, ["j0"], t=4980.0)),
        evaluated_at=5000.0,
    )
    app1.state.runtime.view = FleetView(
        alerts=incident(2, "b1", "j1"),
        nodes=(node("b1", 8, ["j1"]), node("shared", 1, ["j1"], reachable=False)),
        evaluated_at=4998.0,
    )
    app0.state.peers = Peers(["http://shard-1:9472"], Shard(0, 2), transport=httpx.ASGITransport(app=app1))

    own = client0.get("/nodes").json()
    assert [n["node"] for n in own["nodes"]] == ["a1", "shared"] and own["scope"] == "shard"
    nodes = client0.get("/nodes", params={"scope": "fleet"}).json()
    assert (nodes["scope"], nodes["shards_missing"], nodes["evaluated_at"]) == ("fleet", [], 4998.0)
    assert [n["node"] for n in nodes["nodes"]] == ["a1", "b1", "shared"]
    shared = nodes["nodes"][2]
    assert (shared["gpus"], shared["hpc_jobs"], shared["reachable"], shared["open_alerts"]) == (
        2,
        ["j0", "j1"],
        False,
        2,
    )
    assert (shared["last_sample_time"], shared["lag_seconds"]) == (4990.0, 10.0)
    assert nodes["targets"] == own["targets"]  # both shards pull the one agent: listed once

    assert [i["cause"]["summary"] for i in client0.get("/incidents").json()["incidents"]] == ["alert 3", "alert 1"]
    fleet = client0.get("/incidents", params={"scope": "fleet"}).json()
    assert [i["cause"]["summary"] for i in fleet["incidents"]] == ["alert 3", "alert 2", "alert 1"]
    assert [[e["summary"] for e in i["effects"]] for i in fleet["incidents"]] == [
        ["alert 103"],
        ["alert 102"],
        ["alert 101"],
    ]
    assert fleet["scope"] == "fleet" and fleet["shards_missing"] == [] and fleet["shard"] == {"index": 0, "count": 2}
    assert len(client1.get("/incidents", params={"scope": "fleet"}).json()["incidents"]) == 1  # no peers: its own
    page = client0.get("/", params={"scope": "fleet"}).text
    assert "<b>3</b><span class=muted>nodes</span>" in page and "<b>18</b><span class=muted>GPUs</span>" in page

    app0.state.peers = Peers(
        ["http://shard-1:9472"], Shard(0, 2), transport=httpx.MockTransport(lambda r: httpx.Response(503))
    )
    for path, listed in (("/nodes", "nodes"), ("/incidents", "incidents")):
        down = client0.get(path, params={"scope": "fleet"}).json()
        assert down["shards_missing"] == [1] and down["peer_errors"] == [
            {"peer": "http://shard-1:9472", "error": "HTTP 503"}
        ]
        assert len(down[listed]) == 2  # its own part still shown


def test_a_job_less_dcgm_gpu_on_a_host_of_an_owned_job_is_read_and_kept_by_the_jobs_shard() -> None:
    """A GPU that fell off the bus loses its hpc_job label while its job runs on the host's other GPUs: the
    job's shard asks for it (by the host) and keeps it, the shard the host's name hashes to does not."""
    t = 1000.0
    job = JOBS[3]
    host = next(h for h in (f"dcgm-{i}" for i in range(40)) if Shard(0, 2).owns_node(h) != Shard(0, 2).owns_job(job))
    lost = dcgm_series(host, None, t)
    lost["metric"] = {**lost["metric"], "gpu": "1", "UUID": f"GPU-{host}-1"}
    db = Database([dcgm_series(host, job, t), lost])
    kept = {}
    for index in (0, 1):
        shard = Shard(index, 2)
        source = PrometheusSource(
            "http://vm:8428", transport=httpx.MockTransport(db.handler), clock=lambda: t + 1, shard=shard, schema="dcgm"
        )
        result = asyncio.run(source.pull_once())
        asyncio.run(source.aclose())
        parts = [p for s in result.samples if (p := owned_part(s, shard)) is not None]
        kept[index] = sorted(uuid for p in parts for uuid in p.uuids)
    owner = 0 if Shard(0, 2).owns_job(job) else 1
    assert kept[owner] == [f"GPU-{host}", f"GPU-{host}-1"]
    assert kept[1 - owner] == []


def _lost_gpu_run(node: str, first: str, second: str) -> list[Any]:
    """Eight GPUs of `node`, 0-3 in `first`, 4-7 in `second`, every 5 s for 10 minutes: GPU 4 falls off the
    bus at 300 s (reported down, its job label gone with its processes) and `second` ends 20 s later."""
    out = []
    for step in range(120):
        t = 1000.0 + 5 * step
        gpus = []
        for i in range(8):
            job: str | None = first if i < 4 else second
            up = not (i == 4 and t >= 1300)
            if (i == 4 and not up) or (i > 4 and t >= 1320):
                job = None
            gpus.append(
                {"index": i, "uuid": f"GPU-{node}-{i}", "model": "H100", "hpc_job": job, "up": up}
                | {"temperature_celsius": 60.0, "utilization_ratio": 0.9, "sm_active_ratio": 0.8}
            )
        out.append(parse_snapshot({"schema": 1, "node": node, "time": t, "gpus": gpus}))
    return out


def _shard_replay(samples: list[Any], shard: Shard) -> list[Any]:
    """The alerts of one shard over the samples, cut and handed over as replay from a database does."""
    from gpufleet.server.replay import run_samples

    ownership = Ownership(shard)
    parts, handovers, ours = [], [], False
    for sample in samples:
        part = ownership.part(sample)
        if part is None and ours:
            handovers.append((sample.time, sample.node))
        ours = part is not None
        if part is not None:
            parts.append(part)
    return run_samples(parts, handovers=handovers)


def test_a_lost_gpu_stays_with_its_jobs_shard_when_its_job_ends_and_is_not_raised_again_elsewhere() -> None:
    # The lost GPU's job on one shard; the node's other job and its name hashing to the other, where the
    # job-less node would go were ownership decided by the latest labels alone.
    second = JOBS[0]
    theirs = 1 - shard_of(second, 2)
    first = next(j for j in JOBS if shard_of(j, 2) == theirs)
    node = next(n for n in NODES if shard_of(n, 2) == theirs)
    samples = _lost_gpu_run(node, first, second)

    def lost(alerts: list[Any]) -> list[tuple[Any, ...]]:
        return [(a.gpu, a.hpc_job, a.started) for a in alerts if a.kind.value == "gpu_lost"]

    whole = lost(_shard_replay(samples, Shard()))
    assert [(gpu, job) for gpu, job, _ in whole] == [(4, second)]
    union = [a for i in range(2) for a in lost(_shard_replay(samples, Shard(i, 2)))]
    assert union == whole
    # Every GPU to exactly one shard at every sample; the lost one, and its job's GPUs freed while it is
    # down, stay with its job's shard.
    ownerships = [Ownership(Shard(i, 2)) for i in range(2)]
    for sample in samples:
        parts = [o.part(sample) for o in ownerships]
        uuids = [u for p in parts if p is not None for u in p.uuids]
        assert sorted(uuids) == sorted(sample.uuids)
        held = parts[1 - theirs]
        assert held is not None and set(held.indices) == {4, 5, 6, 7}, sample.time
