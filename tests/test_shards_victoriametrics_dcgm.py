"""The shards of tests/test_shards_victoriametrics.py on dcgm-exporter's series: the agents export under
dcgm-exporter's names (`--metrics.names dcgm`: `DCGM_FI_*`, `Hostname`, `hpc_job` on every series), and the
shards read that schema alone, asking VictoriaMetrics by `hpc_job` for their jobs and by `Hostname` for the
node of no job. A module of its own, so that the test runner puts its fleet on another core."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from tests.agent.running import requires_victoria_metrics, victoria_metrics_process
from tests.shards_fleet import (
    Fleet,
    assert_jobless_node_on_its_hash_shard,
    assert_jobs_split_by_owner,
    incident_from_its_owner_alone,
)

pytestmark = requires_victoria_metrics


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(
            tmp_path_factory.mktemp("shards-dcgm"),
            stack,
            victoria_metrics_process,
            agent_args=("--metrics.names", "dcgm"),
            server_args=("--ingest.prometheus-schema", "dcgm"),
        )


def test_the_shards_split_dcgm_exporter_series_by_job_and_node(fleet: Fleet) -> None:
    assert_jobs_split_by_owner(fleet)
    assert_jobless_node_on_its_hash_shard(fleet)


def test_the_incident_is_raised_by_its_jobs_shard_alone(fleet: Fleet) -> None:
    incident_from_its_owner_alone(fleet)
