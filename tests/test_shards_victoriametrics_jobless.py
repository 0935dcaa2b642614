"""Two shards with `--shard.jobless fleet` reading a real VictoriaMetrics that scrapes five simulated agents
(tests/shards_fleet.py): each shard reads the node of no job (the other shard as guests, which its /metrics
counts), yet shows it in `/nodes` only where its name hashes; the jobs split as with `node`, and the incident
comes from its job's shard alone."""

from __future__ import annotations

import contextlib
from typing import Iterator

import httpx
import pytest

from bench.shard_restart_bench import COUNT, JOBLESS
from tests.agent.running import requires_victoria_metrics, victoria_metrics_process
from tests.shards_fleet import (
    Fleet,
    assert_jobless_node_on_its_hash_shard,
    assert_jobs_split_by_owner,
    incident_from_its_owner_alone,
    until,
)

pytestmark = requires_victoria_metrics


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(
            tmp_path_factory.mktemp("shards"),
            stack,
            victoria_metrics_process,
            server_args=("--shard.jobless", "fleet"),
        )


def test_every_shard_reads_the_node_of_no_job_and_only_its_hash_shard_shows_it(fleet: Fleet) -> None:
    assert_jobs_split_by_owner(fleet)
    assert_jobless_node_on_its_hash_shard(fleet)
    owner = _hash_shard()
    (node,) = [n for n in fleet.get(owner, "/nodes")["nodes"] if n["node"] == JOBLESS]
    for index in range(COUNT):
        if index != owner:
            # Read here too, as guests: counted in /metrics, not shown.
            until(
                f"{JOBLESS}'s GPUs read by shard {index}",
                lambda i=index: _guest_gpus(fleet, i) >= node["gpus"],
                fleet.alive,
            )
            assert JOBLESS not in fleet.nodes(index)


def test_an_incident_is_raised_by_exactly_the_shard_that_owns_its_job(fleet: Fleet) -> None:
    incident_from_its_owner_alone(fleet)


def _hash_shard() -> int:
    from gpufleet.server.shard import Shard

    return next(i for i in range(COUNT) if Shard(i, COUNT).owns_node(JOBLESS))


def _guest_gpus(fleet: Fleet, index: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{fleet.ports[index]}/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("gpufleet_server_shard_guest_gpus ")]
    return float(line.split()[1])
