"""A snapshot listing one GPU uuid twice is refused however it comes in: replayed from a record, rebuilt from
Prometheus series or pulled (tests/server/test_pull_identity.py). The same uuids on different nodes are
not this check's business (a synthetic cluster gives every node the same)."""

from __future__ import annotations

import logging

import orjson
import pytest

from gpufleet.server.contract import ContractError, parse_snapshot
from gpufleet.server.replay import load_samples
from gpufleet.server.uuids import duplicate_gpu_uuid
from tests.server.live_fakes import snapshot
from tests.server.test_prometheus_source import FakePrometheus, gpu_series, make_source, run


def _twice(node: str, t: float) -> dict:
    snap = snapshot(node, t)
    snap["gpus"][1]["uuid"] = snap["gpus"][0]["uuid"]
    return snap


def test_the_check_names_the_first_uuid_listed_twice() -> None:
    assert duplicate_gpu_uuid(["GPU-a", "GPU-b", "GPU-c"]) is None
    assert duplicate_gpu_uuid(["GPU-a", "GPU-b", "GPU-b", "GPU-a"]) == "GPU 'GPU-b' twice in one snapshot"
    assert duplicate_gpu_uuid([]) is None


def test_the_contract_refuses_a_snapshot_listing_a_uuid_twice() -> None:
    with pytest.raises(ContractError, match="'GPU-n1-0' twice in one snapshot"):
        parse_snapshot(_twice("n1", 1000.0))
    other = snapshot("n2", 1000.0)
    for gpu in other["gpus"]:
        gpu["uuid"] = f"GPU-n1-{gpu['index']}"  # another node's uuids: its own business
    assert parse_snapshot(other).uuids == ("GPU-n1-0", "GPU-n1-1")


def test_replay_skips_a_line_listing_a_uuid_twice_and_keeps_the_others(caplog) -> None:
    lines = [
        orjson.dumps(snapshot("n1", 1000.0)),
        orjson.dumps(_twice("n1", 1001.0)),
        orjson.dumps(snapshot("n1", 1002.0)),
    ]
    with caplog.at_level(logging.WARNING, logger="gpufleet.server.replay"):
        samples = load_samples([("trace.jsonl", lines)])
    assert [s.time for s in samples] == [1000.0, 1002.0]
    assert "twice in one snapshot" in caplog.records[0].reason  # type: ignore[attr-defined]


def test_the_prometheus_source_refuses_a_scrape_listing_a_uuid_twice() -> None:
    prom = FakePrometheus()
    twin = gpu_series("dgx-01", 1, [990.0])
    for s in twin:
        s["metric"]["uuid"] = "GPU-dgx-01-0"  # two indices, one uuid
    prom.stored = gpu_series("dgx-01", 0, [990.0]) + twin + gpu_series("dgx-02", 0, [990.0], instance="10.0.0.2:9471")
    src, _ = make_source(prom)
    result = run(src.pull_once())
    assert [s.node for s in result.samples] == ["dgx-02"]
    assert src.errors == {("http://prometheus:9090", "schema"): 1}
