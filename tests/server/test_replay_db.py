"""replay --prometheus-url: its times, its flags' errors, the shard's part of a snapshot (ingest/owned.py),
and reading a history in chunks (a stand-in query API that records what it was asked; the real database is in
tests/test_replay_db_end_to_end.py and tests/test_shard_union.py)."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import orjson
import pytest

from gpufleet.server import replay_db
from gpufleet.server.contract import N_FIELDS, NodeSample
from gpufleet.server.ingest.owned import owned_part
from gpufleet.server.ingest.prometheus import SCHEMAS
from gpufleet.server.replay import main
from gpufleet.server.shard import Shard, shard_of


def test_times_are_unix_seconds_or_rfc3339_with_an_offset() -> None:
    assert replay_db.parse_time("1764284400") == 1764284400.0
    assert replay_db.parse_time("1764284400.5") == 1764284400.5
    assert replay_db.parse_time("2025-11-27T23:00:00Z") == 1764284400.0
    assert replay_db.parse_time("2025-11-28T00:00:00+01:00") == 1764284400.0
    for bad in ("2025-11-27T23:00:00", "yesterday", "nan", "-5", ""):
        with pytest.raises(ValueError):
            replay_db.parse_time(bad)


def test_the_schemas_offered_are_the_sources() -> None:
    assert replay_db.SCHEMAS == SCHEMAS


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prometheus-url", "http://db:8428", "--start", "10"], "needs --start and --end"),
        (["--prometheus-url", "http://db:8428", "--start", "10", "--end", "10"], "must be after --start"),
        (["--prometheus-url", "http://db:8428", "--start", "2025-11-27T23:00:00", "--end", "5"], "offset"),
        (["--prometheus-url", "db:8428", "--start", "1", "--end", "5"], "http:// or https://"),
        (["--prometheus-url", "http://db:8428", "--start", "1", "--end", "5", "--shard", "2/2"], "not in 0..1"),
        (["--prometheus-url", "http://db:8428", "--start", "1", "--end", "5", "--shard", "x"], "INDEX/COUNT"),
        (["--prometheus-url", "http://db:8428", "--start", "1", "--end", "5", "--chunk", "0"], "--chunk"),
        (["t.jsonl", "--prometheus-url", "http://db:8428", "--start", "1", "--end", "5"], "not both"),
        ([], "give TRACE files, or --prometheus-url"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, says, capsys) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err


def test_a_database_that_cannot_be_reached_exits_2_naming_it(capsys) -> None:
    # Port 1 on the loopback: nothing listens there, the connection is refused at once.
    assert main(["--prometheus-url", "http://127.0.0.1:1", "--start", "1", "--end", "5", "--log.level", "error"]) == 2
    assert "http://127.0.0.1:1" in capsys.readouterr().err


def _sample(node: str, jobs: tuple[str | None, ...]) -> NodeSample:
    n = len(jobs)
    values = np.arange(n * N_FIELDS, dtype=np.float64).reshape(n, N_FIELDS)
    pods = tuple(("ns", f"pod-{i}") for i in range(n))
    xids = tuple({43: i} for i in range(n))
    return NodeSample(
        node, 100.0, tuple(range(n)), tuple(f"GPU-{i}" for i in range(n)), ("m",) * n, jobs, values, xids, pods
    )  # type: ignore[arg-type]


def test_a_shard_keeps_the_gpus_of_its_jobs_and_a_nodes_jobless_gpus_go_with_its_job() -> None:
    jobs = [f"job-{i}" for i in range(40)]
    mine = next(j for j in jobs if shard_of(j, 2) == 0)
    theirs = next(j for j in jobs if shard_of(j, 2) == 1 and j > mine)  # of a node's jobs, the least decides
    here = next(f"n{i}" for i in range(40) if shard_of(f"n{i}", 2) == 0)
    there = next(f"n{i}" for i in range(40) if shard_of(f"n{i}", 2) == 1)
    # On a node hashing elsewhere, a GPU that lost its job label (fallen off the bus) stays with the job.
    sample = _sample(there, (theirs, mine, None, mine))
    part = owned_part(sample, Shard(0, 2))
    assert part is not None
    assert part.indices == (1, 2, 3) and part.jobs == (mine, None, mine) and part.uuids == ("GPU-1", "GPU-2", "GPU-3")
    assert (part.values == sample.values[[1, 2, 3]]).all()
    assert part.pods == (("ns", "pod-1"), ("ns", "pod-2"), ("ns", "pod-3"))
    assert part.xid_by_code == ({43: 1}, {43: 2}, {43: 3})
    other = owned_part(sample, Shard(1, 2))
    assert other is not None and other.jobs == (theirs,)
    # A node running no job at all goes by its name.
    idle = _sample(here, (None, None))
    assert owned_part(idle, Shard(0, 2)) is idle and owned_part(idle, Shard(1, 2)) is None
    assert owned_part(_sample(here, (theirs,)), Shard(0, 2)) is None
    assert owned_part(sample, Shard()) is sample


class _Database:
    """Answers the source's range-selector queries from points it holds, recording each query's range."""

    def __init__(self, points: list[tuple[float, str, str]]) -> None:
        self.points = points  # (time, node, hpc_job)
        self.asked: list[tuple[float, float]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        query, at = request.url.params["query"], float(request.url.params["time"])
        if query.startswith("up{"):
            return _answer("vector", [])
        seconds = float(re.search(r"\[(\d+)s\]$", query).group(1))  # type: ignore[union-attr]
        self.asked.append((at - seconds, at))
        series: dict[tuple, dict] = {}
        for t, node, job in self.points:
            if not at - seconds < t <= at:
                continue
            ids = {"node": node, "gpu": "0", "uuid": f"GPU-{node}"}
            for labels, value in (
                ({"__name__": "gpufleet_gpu_up", **ids}, "1"),
                ({"__name__": "gpufleet_gpu_temperature_celsius", **ids}, "50"),
                ({"__name__": "gpufleet_gpu_job_info", **ids, "hpc_job": job}, "1"),
                ({"__name__": "gpufleet_agent_sample_age_seconds", "node": node}, "0"),
            ):
                entry = series.setdefault(tuple(sorted(labels.items())), {"metric": labels, "values": []})
                entry["values"].append([t, value])
        return _answer("matrix", list(series.values()))


def _answer(kind: str, result: list) -> httpx.Response:
    return httpx.Response(
        200, content=orjson.dumps({"status": "success", "data": {"resultType": kind, "result": result}})
    )


def test_a_range_is_read_in_overlapping_chunks_and_each_sample_delivered_once() -> None:
    jobs = [f"job-{i}" for i in range(20)]
    points = [(1000.0 + t, f"node-{j}", job) for t in range(0, 301, 5) for j, job in enumerate(jobs)]
    db = _Database(points)
    history = asyncio.run(
        replay_db.read_history(
            "http://db:8428", 1000.0, 1300.0, chunk_seconds=60, transport=httpx.MockTransport(db.handler)
        )
    )
    # (1000, 1300]: everything but the points at the start itself, each once.
    assert sorted((s.time, s.node) for s in history.samples) == sorted((t, n) for t, n, _ in points if t > 1000.0)
    covered = sorted(db.asked)
    assert covered[0][0] <= 1000.0 and covered[-1][1] == 1300.0
    assert all(b[0] < a[1] for a, b in zip(covered, covered[1:])), "a gap between two chunks"
    assert len(covered) == 5 and all(hi - lo <= 62 for lo, hi in covered)


def _raise(exc: Exception) -> httpx.Response:
    raise exc


@pytest.mark.parametrize(
    "failure",
    [
        lambda: httpx.Response(503, content=b'{"status":"error","errorType":"503","error":"too many queries"}'),
        lambda: _raise(httpx.ReadTimeout("no answer")),
    ],
    ids=["error answer", "timeout"],
)
def test_a_chunk_the_database_does_not_answer_stops_the_replay_not_a_silence(failure) -> None:
    # Taken as a range without samples, the chunk would read as every node going quiet and coming back.
    db = _Database([(1000.0 + t, "node-0", "job-0") for t in range(0, 301, 5)])
    chunks = []

    def handler(request: httpx.Request) -> httpx.Response:
        if not request.url.params["query"].startswith("up{"):
            chunks.append(request)
            if len(chunks) == 3:
                return failure()
        return db.handler(request)

    with pytest.raises(replay_db.HistoryError, match=r"http://db:8428 up to 1181"):
        asyncio.run(
            replay_db.read_history(
                "http://db:8428", 1000.0, 1300.0, chunk_seconds=60, transport=httpx.MockTransport(handler)
            )
        )


def _node_samples(node: str, until: float, offset: float = 0.0) -> list[NodeSample]:
    from gpufleet.server.contract import parse_snapshot

    out = []
    for t in range(0, int(until), 5):
        gpus = [{"index": i, "uuid": f"GPU-{node}-{i}", "model": "H100", "hpc_job": None, "up": True} for i in range(2)]
        out.append(parse_snapshot({"schema": 1, "node": node, "time": 10_000.0 + offset + t, "gpus": gpus}))
    return out


def test_a_node_handed_over_to_another_shard_is_forgotten_not_unreachable() -> None:
    from gpufleet.server.replay import run_samples

    # Three nodes for 15 minutes; one stops after 5, as a node whose GPUs pass to another shard's job does: its
    # hand-over is the time of its first sample of another shard, before its last owned one is in a closed bin
    # (the other nodes report within the bin).
    samples = sorted(
        [*_node_samples("a", 900, 2.0), *_node_samples("b", 900, 3.0), *_node_samples("gone", 300)],
        key=lambda s: (s.time, s.node),
    )
    unreachable = [a.node for a in run_samples(samples) if a.kind.value == "node_unreachable"]
    assert unreachable == ["gone"]
    assert [a for a in run_samples(samples, handovers=[(10_296.0, "gone")]) if a.node == "gone"] == []
