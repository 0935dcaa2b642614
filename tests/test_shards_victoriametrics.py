"""Two shards (`--shard 0/2`, `--shard 1/2`) reading a real VictoriaMetrics that scrapes five simulated agents.

Four jobs of one node each and one node of no job; a cooling failure on one GPU of job 81004 from the start.
The shards' jobs are disjoint and cover the fleet, the incident is raised by the shard that owns its job and by
no other, any shard's fleet view (`?scope=fleet`) shows all of it or says which shard did not answer, and the
owning shard, restarted with an empty alert store (a pod rescheduled without its volume), raises the incident
again from the database's history: its alert went pending before the restart.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from bench.shard_restart_bench import COUNT, JOBS, owner_of_job
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
        yield Fleet(tmp_path_factory.mktemp("shards"), stack, victoria_metrics_process)


def test_the_shards_jobs_are_disjoint_and_cover_every_job(fleet: Fleet) -> None:
    assert_jobs_split_by_owner(fleet)
    for index in range(COUNT):
        answer = fleet.get(index, "/jobs")
        assert answer["shard"] == {"index": index, "count": COUNT} and answer["scope"] == "shard"


def test_a_gpu_of_no_job_is_judged_by_the_shard_its_node_hashes_to(fleet: Fleet) -> None:
    assert_jobless_node_on_its_hash_shard(fleet)


def test_an_incident_is_raised_by_exactly_the_shard_that_owns_its_job(fleet: Fleet) -> None:
    owner, alert = incident_from_its_owner_alone(fleet)
    for other in range(COUNT):
        if other != owner:
            # Any shard shows the whole fleet on asking: the incident, and no shard missing.
            fleet_view = fleet.get(other, "/alerts", scope="fleet", kind="thermal_throttle")
            assert [a["id"] for a in fleet_view["alerts"]] == [alert["id"]]
            assert fleet_view["scope"] == "fleet" and fleet_view["shards_missing"] == []
            assert fleet.jobs(other, scope="fleet") == set(JOBS)


def test_a_restarted_shard_raises_the_incident_again_from_history(fleet: Fleet) -> None:
    owner = owner_of_job("81004")
    other = (owner + 1) % COUNT
    until(f"thermal_throttle firing on shard {owner}", lambda: fleet.hot_alerts(owner, state="firing"), fleet.alive)
    fleet.stop(owner)
    # Meanwhile the other shard's fleet view says plainly whose part is missing.
    down = fleet.get(other, "/jobs", scope="fleet")
    assert down["shards_missing"] == [owner] and [e["peer"] for e in down["peer_errors"]] == [
        f"http://127.0.0.1:{fleet.ports[owner]}"
    ]
    assert {j["hpc_job"] for j in down["jobs"]} == {j for j in JOBS if owner_of_job(j) == other}
    restarted_at = fleet.start(owner, "restarted")
    (alert,) = until(
        f"thermal_throttle firing again on restarted shard {owner}",
        lambda: fleet.hot_alerts(owner, state="firing"),
        fleet.alive,
    )
    # A fresh store: the alert is the engine's, from windows warmed by the database's history.
    assert alert["pending_since"] < restarted_at
    assert fleet.hot_alerts(other) == []
