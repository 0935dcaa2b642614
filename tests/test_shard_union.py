"""The shards' alerts together are one unsharded server's, replayed from a real VictoriaMetrics.

A few scenarios of the suite (bench/evaluation/shard_union.py runs all of them, docs/evaluation.md): each
trace loaded into the database as agents' series at its sample times, replayed once whole and once per
shard of three. Chosen for what sharding could break: two jobs on the same nodes (a node's GPUs split
between shards), GPUs of no job (owned by their node's hash), a node lost with its job's other nodes
hanging (a node-level alert), a busy cluster whose job-less nodes get a job (they pass to the job's
shard: handed over, not left to read as unreachable on the shard their names hash to), and a GPU lost
before its job ends (it stays with the job's shard, on a node whose name hashes to another at 3 shards).
With `--shard.jobless fleet` (every shard reads every GPU of no job) the union holds for `unattributed_fleet`
too, whose inferred jobs span nodes of several shards.
"""

from __future__ import annotations

import pytest

from bench.evaluation import victoria
from bench.evaluation import shard_union

pytestmark = pytest.mark.skipif(victoria.BINARY is None, reason=victoria.WHY_MISSING)


@pytest.mark.parametrize(
    "name", ["straggler_on_shared_node", "straggler_unattributed", "node_crash", "busy_8", "gpu_lost"]
)
def test_the_union_of_three_shards_alerts_is_the_unsharded_servers(name: str) -> None:
    with victoria.victoria_metrics() as url:
        start, end = shard_union.load_scenario(url, name, seed=0)
        (result,) = shard_union.compare(url, start, end, [3], name)
    assert result.whole, "the scenario must raise something to compare"
    assert result.equal, f"only unsharded: {result.unmatched_whole}; only in shards: {result.unmatched_shards}"
    assert not result.twice, f"raised by two shards: {result.twice}"


@pytest.mark.parametrize("name", ["unattributed_fleet", "busy_8", "gpu_lost"])
def test_with_every_gpu_of_no_job_read_by_every_shard_the_union_is_the_unsharded_servers(name: str) -> None:
    # unattributed_fleet: jobs inferred across nodes that hash to different shards, judged whole by each shard
    # and published by one; busy_8: job-less nodes that get a job (guests that become another shard's job's
    # GPUs); gpu_lost: a lost GPU read by every shard once its label goes, published by its job's alone.
    with victoria.victoria_metrics() as url:
        start, end = shard_union.load_scenario(url, name, seed=0)
        (result,) = shard_union.compare(url, start, end, [3], name, jobless=["fleet"])
    assert result.jobless == "fleet" and result.whole, "the scenario must raise something to compare"
    assert result.equal, f"only unsharded: {result.unmatched_whole}; only in shards: {result.unmatched_shards}"
    assert not result.twice, f"raised by two shards: {result.twice}"
