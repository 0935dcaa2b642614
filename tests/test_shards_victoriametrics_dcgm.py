"""The shards of tests/test_shards_victoriametrics.py on dcgm-exporter's series: the agents export under
dcgm-exporter's names (`--metrics.names dcgm`: `DCGM_FI_*`, `Hostname`, `hpc_job` on every series), and the
shards read that schema alone, asking VictoriaMetrics by `hpc_job` for their jobs and by `Hostname` for the
node of no job. A module of its own, so that the test runner puts its fleet on another core."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from bench.shard_restart_bench import COUNT, HOT, JOBLESS, JOBS, owner_of_job
from gpufleet.server.shard import Shard
from tests.agent.running import requires_victoria_metrics
from tests.test_shards_victoriametrics import Fleet, until

pytestmark = requires_victoria_metrics


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(
            tmp_path_factory.mktemp("shards-dcgm"),
            stack,
            agent_args=("--metrics.names", "dcgm"),
            server_args=("--ingest.prometheus-schema", "dcgm"),
        )


def test_the_shards_split_dcgm_exporter_series_by_job_and_node(fleet: Fleet) -> None:
    until(
        "every job on some shard", lambda: set().union(*(fleet.jobs(i) for i in range(COUNT))) == set(JOBS), fleet.alive
    )
    for index in range(COUNT):
        assert fleet.jobs(index) == {j for j in JOBS if owner_of_job(j) == index}
    owner = next(i for i in range(COUNT) if Shard(i, COUNT).owns_node(JOBLESS))
    until(
        f"{JOBLESS} on shard {owner}",
        lambda: JOBLESS in {n["node"] for n in fleet.get(owner, "/nodes")["nodes"]},
        fleet.alive,
    )
    assert all(JOBLESS not in {n["node"] for n in fleet.get(i, "/nodes")["nodes"]} for i in range(COUNT) if i != owner)


def test_the_incident_is_raised_by_its_jobs_shard_alone(fleet: Fleet) -> None:
    owner = owner_of_job("81004")
    (alert,) = until(f"thermal_throttle on {HOT} from shard {owner}", lambda: fleet.hot_alerts(owner), fleet.alive)
    assert alert["hpc_job"] == "81004"
    assert all(fleet.get(i, "/alerts", kind="thermal_throttle")["alerts"] == [] for i in range(COUNT) if i != owner)
