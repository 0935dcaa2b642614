"""The shards of tests/test_shards_victoriametrics.py reading a real Prometheus instead: two shards
(`--shard 0/2`, `--shard 1/2`) asking one Prometheus, which scrapes the five simulated agents, for their own
series only. Their jobs are disjoint and cover the fleet, the node of no job is its hash's shard's, the
cooling failure in job 81004 is raised by the shard that owns the job and by no other, either shard's fleet
view (`?scope=fleet`) shows every node and the incident, and the owning shard, restarted with an empty alert
store, raises it again from Prometheus's history."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from bench.shard_restart_bench import COUNT, JOBLESS, JOBS, owner_of_job
from tests.agent.running import prometheus_process, requires_prometheus
from tests.shards_fleet import (
    Fleet,
    assert_jobless_node_on_its_hash_shard,
    assert_jobs_split_by_owner,
    incident_from_its_owner_alone,
    until,
)

pytestmark = requires_prometheus


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(tmp_path_factory.mktemp("shards-prometheus"), stack, prometheus_process)


def test_the_shards_jobs_are_disjoint_and_cover_every_job(fleet: Fleet) -> None:
    assert_jobs_split_by_owner(fleet)
    assert all(fleet.get(i, "/jobs")["shard"] == {"index": i, "count": COUNT} for i in range(COUNT))


def test_a_gpu_of_no_job_is_judged_by_the_shard_its_node_hashes_to(fleet: Fleet) -> None:
    assert_jobless_node_on_its_hash_shard(fleet)


def test_an_incident_is_raised_by_exactly_the_shard_that_owns_its_job(fleet: Fleet) -> None:
    incident_from_its_owner_alone(fleet)


def test_either_shards_fleet_view_shows_every_node_and_the_incident(fleet: Fleet) -> None:
    owner, alert = incident_from_its_owner_alone(fleet)
    every_node = {*JOBS.values(), JOBLESS}
    for index in range(COUNT):
        until(
            f"every node in shard {index}'s fleet view",
            lambda index=index: fleet.nodes(index, scope="fleet") == every_node,
            fleet.alive,
        )
        view = fleet.get(index, "/incidents", scope="fleet")
        assert view["scope"] == "fleet" and view["shards_missing"] == []
        assert alert["id"] in {i["id"] for i in view["incidents"]}
        own = {i["id"] for i in fleet.get(index, "/incidents")["incidents"]}
        assert (alert["id"] in own) == (index == owner)


def test_a_restarted_shard_raises_the_incident_again_from_history(fleet: Fleet) -> None:
    owner = owner_of_job("81004")
    until(f"thermal_throttle firing on shard {owner}", lambda: fleet.hot_alerts(owner, state="firing"), fleet.alive)
    fleet.stop(owner)
    restarted_at = fleet.start(owner, "restarted")
    (alert,) = until(
        f"thermal_throttle firing again on restarted shard {owner}",
        lambda: fleet.hot_alerts(owner, state="firing"),
        fleet.alive,
    )
    # A fresh store: the alert is the engine's, from windows warmed by Prometheus's history.
    assert alert["pending_since"] < restarted_at
    assert all(fleet.hot_alerts(i) == [] for i in range(COUNT) if i != owner)
