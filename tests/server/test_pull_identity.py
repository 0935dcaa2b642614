"""A node's GPUs are its own: a snapshot listing one GPU uuid twice is rejected, and a GPU reported by one
node cannot be reported by another."""

from __future__ import annotations

import orjson

from tests.server.live_fakes import envelope, snapshot
from tests.server.test_pull_limits import RingAgents, cycles, make


def test_a_snapshot_listing_a_gpu_uuid_twice_is_rejected_with_its_reason() -> None:
    agents = RingAgents({"a:1": "hgx-01"})
    twice = snapshot("hgx-01", 1000.0)
    twice["gpus"][1]["uuid"] = twice["gpus"][0]["uuid"]
    agents.body["a:1"] = orjson.dumps(envelope("hgx-01", [snapshot("hgx-01", 999.0), twice]))
    puller = make(agents)
    [result] = cycles(puller, 1)
    assert [s["time"] for s in result.samples] == [999.0] and result.rejected_snapshots == 1
    assert puller.errors == {("a:1", "duplicate_gpu_uuid"): 1}


def test_a_gpu_another_node_reported_is_refused_until_that_node_leaves() -> None:
    agents = RingAgents({"a:1": "hgx-01", "b:1": "hgx-02"}, ring_seconds=1)
    copied = snapshot("hgx-02", 1000.0)
    copied["gpus"][0]["uuid"] = "GPU-hgx-01-0"  # hgx-01's first GPU, under another node's name
    agents.body["b:1"] = orjson.dumps(envelope("hgx-02", [copied]))
    puller = make(agents)
    [result] = cycles(puller, 1)
    assert [s["node"] for s in result.samples] == ["hgx-01"]
    assert puller.errors == {("b:1", "gpu_claimed"): 1}
