"""A snapshot listing one GPU uuid twice is rejected with its reason, the others of its answer kept."""

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
