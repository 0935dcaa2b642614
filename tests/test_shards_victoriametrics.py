"""Two shards (`--shard 0/2`, `--shard 1/2`) reading a real VictoriaMetrics that scrapes five simulated agents.

Four jobs of one node each and one node of no job; a cooling failure on one GPU of job 81004 from the start.
The shards' jobs are disjoint and cover the fleet, the incident is raised by the shard that owns its job and by
no other, any shard's fleet view (`?scope=fleet`) shows all of it or says which shard did not answer, and the
owning shard, restarted with an empty alert store (a pod rescheduled without its volume), raises the incident
again from the database's history: its alert went pending before the restart.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from bench.shard_restart_bench import COUNT, HOT, JOBLESS, JOBS, SCENARIO, owner_of_job
from gpufleet.server.shard import Shard
from tests.agent.running import (
    agent_process,
    free_port,
    requires_victoria_metrics,
    server_process,
    victoria_metrics_process,
)

pytestmark = requires_victoria_metrics

DEADLINE_SECONDS = 240.0  # from cold: the GPU must heat, VictoriaMetrics scrape, the thermal rule hold for its `for`
POLL_SECONDS = 0.5


def until(what: str, check: Callable[[], Any], alive: Callable[[], None], deadline: float = DEADLINE_SECONDS) -> Any:
    """Poll `check` until it gives something truthy (returned), failing after `deadline` seconds."""
    waiter = threading.Event()
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        alive()
        with contextlib.suppress(httpx.TransportError):
            if found := check():
                return found
        waiter.wait(POLL_SECONDS)
    pytest.fail(f"never within {deadline:.0f} s: {what}")


class Fleet:
    """The running processes: agents, VictoriaMetrics, and one server per shard (restartable)."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.tmp = tmp
        scenario = tmp / "shards.yaml"
        scenario.write_text(SCENARIO)
        ports = [
            stack.enter_context(agent_process("--simulate", str(scenario), "--node", node))[1]
            for node in [*JOBS.values(), JOBLESS]
        ]
        self.victoria, self.victoria_port, self.victoria_log = stack.enter_context(victoria_metrics_process(tmp, ports))
        self.ports = [free_port() for _ in range(COUNT)]
        self.servers: dict[int, tuple[contextlib.ExitStack, Any]] = {}
        for index in range(COUNT):
            self.start(index, "first")
        stack.callback(self.stop_all)

    def start(self, index: int, run: str) -> float:
        """Start shard `index` with an alert store of its own for this `run`, once it listens; returns when
        its process was started."""
        started = time.time()
        folder = self.tmp / f"shard{index}-{run}"
        folder.mkdir()
        peers = ",".join(f"http://127.0.0.1:{p}" for p in self.ports)
        stack = contextlib.ExitStack()
        proc, _ = stack.enter_context(
            server_process(
                folder,
                "--shard",
                f"{index}/{COUNT}",
                "--ingest.prometheus-url",
                f"http://127.0.0.1:{self.victoria_port}",
                "--pull.interval",
                "2s",
                "--pull.timeout",
                "2s",
                "--shard.peers",
                peers,
                "--web.listen-address",
                f"127.0.0.1:{self.ports[index]}",
            )
        )
        self.servers[index] = (stack, proc)
        return started

    def stop(self, index: int) -> None:
        stack, _ = self.servers.pop(index)
        stack.close()

    def stop_all(self) -> None:
        for index in list(self.servers):
            self.stop(index)

    def alive(self) -> None:
        assert self.victoria.poll() is None, self.victoria_log.read_text(errors="replace")[-2000:]
        for index, (_, proc) in self.servers.items():
            assert proc.poll() is None, f"shard {index} exited with {proc.returncode}"

    def get(self, index: int, path: str, **params: Any) -> Any:
        answer = httpx.get(f"http://127.0.0.1:{self.ports[index]}{path}", params=params, timeout=10)
        answer.raise_for_status()
        return answer.json()

    def jobs(self, index: int, **params: Any) -> set[str]:
        return {j["hpc_job"] for j in self.get(index, "/jobs", **params)["jobs"]}

    def hot_alerts(self, index: int, **params: Any) -> list[dict]:
        alerts = self.get(index, "/alerts", kind="thermal_throttle", **params)["alerts"]
        return [a for a in alerts if (a["node"], a["gpu"]) == HOT]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(tmp_path_factory.mktemp("shards"), stack)


def test_the_shards_jobs_are_disjoint_and_cover_every_job(fleet: Fleet) -> None:
    until(
        "every job on some shard", lambda: set().union(*(fleet.jobs(i) for i in range(COUNT))) == set(JOBS), fleet.alive
    )
    parts = [fleet.jobs(i) for i in range(COUNT)]
    assert all(parts), f"a shard owns none of four jobs, which the test's job ids are chosen to avoid: {parts}"
    for index, part in enumerate(parts):
        assert part == {j for j in JOBS if owner_of_job(j) == index}
    for index in range(COUNT):
        answer = fleet.get(index, "/jobs")
        assert answer["shard"] == {"index": index, "count": COUNT} and answer["scope"] == "shard"


def test_a_gpu_of_no_job_is_judged_by_the_shard_its_node_hashes_to(fleet: Fleet) -> None:
    owner = next(i for i in range(COUNT) if Shard(i, COUNT).owns_node(JOBLESS))

    def nodes(index: int) -> set[str]:
        return {n["node"] for n in fleet.get(index, "/nodes")["nodes"]}

    until(f"{JOBLESS} on shard {owner}", lambda: JOBLESS in nodes(owner), fleet.alive)
    assert all(JOBLESS not in nodes(i) for i in range(COUNT) if i != owner)


def test_an_incident_is_raised_by_exactly_the_shard_that_owns_its_job(fleet: Fleet) -> None:
    owner = owner_of_job("81004")
    (alert,) = until(f"thermal_throttle on {HOT} from shard {owner}", lambda: fleet.hot_alerts(owner), fleet.alive)
    assert alert["hpc_job"] == "81004"
    for other in range(COUNT):
        if other != owner:
            assert fleet.get(other, "/alerts", kind="thermal_throttle")["alerts"] == []
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
