"""Two shards (`--shard 0/2`, `--shard 1/2`) reading one real Prometheus-compatible database that scrapes five
simulated agents (bench/shard_restart_bench.py's SCENARIO: four jobs of one node each, a node of no job, a
cooling failure on one GPU of job 81004 from the start), and the acceptance checks every such database must
pass: the shards' jobs are disjoint and cover the fleet, the node of no job is its hash's shard's, and the
incident is raised by the shard that owns its job and by no other.

tests/test_shards_victoriametrics.py, tests/test_shards_victoriametrics_dcgm.py and
tests/test_shards_prometheus.py run them on their own database.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import httpx
import pytest

from bench.shard_restart_bench import COUNT, HOT, JOBLESS, JOBS, SCENARIO, owner_of_job
from gpufleet.server.shard import Shard
from tests.agent.running import agent_process, free_port, server_process

DEADLINE_SECONDS = 240.0  # from cold: the GPU must heat, the database scrape, the thermal rule hold for its `for`
POLL_SECONDS = 0.5

# (folder, the agents' ports) -> a running database scraping them: (process, port, log), as
# tests/agent/running.py's victoria_metrics_process and prometheus_process give.
Database = Callable[[Path, list[int]], ContextManager[tuple[Any, int, Path]]]


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
    """The running processes: agents, the database, and one server per shard (restartable)."""

    def __init__(
        self,
        tmp: Path,
        stack: contextlib.ExitStack,
        database: Database,
        *,
        agent_args: tuple[str, ...] = (),
        server_args: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        self.server_args = server_args
        scenario = tmp / "shards.yaml"
        scenario.write_text(SCENARIO)
        ports = [
            stack.enter_context(agent_process("--simulate", str(scenario), "--node", node, *agent_args))[1]
            for node in [*JOBS.values(), JOBLESS]
        ]
        self.database, self.database_port, self.database_log = stack.enter_context(database(tmp, ports))
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
                f"http://127.0.0.1:{self.database_port}",
                "--pull.interval",
                "2s",
                "--pull.timeout",
                "2s",
                "--shard.peers",
                peers,
                "--web.listen-address",
                f"127.0.0.1:{self.ports[index]}",
                *self.server_args,
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
        assert self.database.poll() is None, self.database_log.read_text(errors="replace")[-2000:]
        for index, (_, proc) in self.servers.items():
            assert proc.poll() is None, f"shard {index} exited with {proc.returncode}"

    def get(self, index: int, path: str, **params: Any) -> Any:
        answer = httpx.get(f"http://127.0.0.1:{self.ports[index]}{path}", params=params, timeout=10)
        answer.raise_for_status()
        return answer.json()

    def jobs(self, index: int, **params: Any) -> set[str]:
        return {j["hpc_job"] for j in self.get(index, "/jobs", **params)["jobs"]}

    def nodes(self, index: int, **params: Any) -> set[str]:
        return {n["node"] for n in self.get(index, "/nodes", **params)["nodes"]}

    def hot_alerts(self, index: int, **params: Any) -> list[dict]:
        alerts = self.get(index, "/alerts", kind="thermal_throttle", **params)["alerts"]
        return [a for a in alerts if (a["node"], a["gpu"]) == HOT]


def assert_jobs_split_by_owner(fleet: Fleet) -> list[set[str]]:
    """Once every job is on some shard: each shard's /jobs holds exactly the jobs that hash to it, so the
    parts are disjoint and cover every job. Returns the parts, by shard."""
    until(
        "every job on some shard", lambda: set().union(*(fleet.jobs(i) for i in range(COUNT))) == set(JOBS), fleet.alive
    )
    parts = [fleet.jobs(i) for i in range(COUNT)]
    assert all(parts), f"a shard owns none of four jobs, which the test's job ids are chosen to avoid: {parts}"
    for index, part in enumerate(parts):
        assert part == {j for j in JOBS if owner_of_job(j) == index}
    return parts


def assert_jobless_node_on_its_hash_shard(fleet: Fleet) -> None:
    """The node of no job shows on the shard its name hashes to, and on no other."""
    owner = next(i for i in range(COUNT) if Shard(i, COUNT).owns_node(JOBLESS))
    until(f"{JOBLESS} on shard {owner}", lambda: JOBLESS in fleet.nodes(owner), fleet.alive)
    assert all(JOBLESS not in fleet.nodes(i) for i in range(COUNT) if i != owner)


def incident_from_its_owner_alone(fleet: Fleet) -> tuple[int, dict]:
    """The cooling failure's thermal_throttle alert, once the shard owning job 81004 raised it, with that
    shard; every other shard has no thermal_throttle alert at all."""
    owner = owner_of_job("81004")
    (alert,) = until(f"thermal_throttle on {HOT} from shard {owner}", lambda: fleet.hot_alerts(owner), fleet.alive)
    assert alert["hpc_job"] == "81004"
    for other in range(COUNT):
        if other != owner:
            assert fleet.get(other, "/alerts", kind="thermal_throttle")["alerts"] == []
    return owner, alert
