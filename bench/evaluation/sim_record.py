"""Record a simulated node through the production agent pipeline, in simulated time.

SimNvml, NvmlReader, JobAttributor over the simulator's procfs, Sampler and Recorder run exactly as in
`gpufleet-agent --simulate … --record`, but on a fake clock advanced one sampling interval per cycle,
so a 15-minute scenario records in seconds. Used by the end-to-end tests and by
bench/evaluation/sim_crosscheck.py. XID events arrive on the reader's own thread in real time, so in simulated
time they land a few to tens of seconds late: do not time XIDs on these traces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from gpufleet.agent.attribution import DEFAULT_ENV_VARS, JobAttributor
from gpufleet.agent.cli import SettableClock
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.record import Recorder
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import Scenario, SimNvml
from gpufleet.agent.model import NodeSnapshot
from gpufleet.agent.store import Publication, SnapshotStore

T0 = 1_763_800_000.0


def record_node(
    scenario: Scenario,
    node: str,
    workdir: Path,
    duration_seconds: float,
    interval_seconds: float = 1.0,
    env_vars: tuple[str, ...] = DEFAULT_ENV_VARS,
) -> tuple[Path, list[float]]:
    """Sample one simulated node from T0 for duration_seconds; returns its --record file and the
    offsets (seconds from T0) of the cycles that produced no sample (NVML down, by the scenario)."""
    trace = workdir / f"{node}.jsonl"
    missing = [
        now - T0
        for now, snapshot, _ in sample_node(
            scenario, node, workdir, duration_seconds, interval_seconds, trace, env_vars
        )
        if snapshot is None
    ]
    return trace, missing


def record_cluster(
    scenario: Scenario,
    workdir: Path,
    duration_seconds: float,
    interval_seconds: float = 1.0,
    env_vars: tuple[str, ...] = DEFAULT_ENV_VARS,
) -> list[bytes]:
    """Every node recorded, then the files joined node after node as `cat` would: the replay input.
    A node that missed a sample fails the caller, since the scenarios recorded this way expect none.
    `env_vars`: the agent's --hpc-job-env-vars."""
    files = []
    for node in scenario.nodes:
        trace, missing = record_node(scenario, node, workdir, duration_seconds, interval_seconds, env_vars)
        assert not missing, f"{node}: no sample at +{missing[0]:.0f}s"
        files.append(trace)
    return b"".join(f.read_bytes() for f in files).splitlines()


def sample_node(
    scenario: Scenario,
    node: str,
    workdir: Path,
    duration_seconds: float,
    interval_seconds: float = 1.0,
    record_to: Path | None = None,
    env_vars: tuple[str, ...] = DEFAULT_ENV_VARS,
) -> Iterator[tuple[float, NodeSnapshot | None, Publication]]:
    """Each cycle's (simulated time, new snapshot or None, the store's publication after it)."""
    clock = SettableClock(T0)
    nvml = SimNvml(scenario, node, clock=clock, epoch=T0)
    procfs = workdir / f"proc-{node}"
    nvml.materialize_procfs(procfs)
    recorder = Recorder(record_to, monotonic=clock) if record_to is not None else None
    store = SnapshotStore()
    # A budget of a whole core: recorded traces must not depend on how fast this machine runs the
    # simulator's Python, which the sampling tiers would otherwise measure as NVML cost.
    reader = NvmlReader(nvml, xid_wait_ms=50, cpu_budget=1.0, interval_s=interval_seconds, clock=clock)
    sampler = Sampler(
        reader,
        store,
        node=node,
        interval=interval_seconds,
        attributor=JobAttributor(procfs, env_vars=env_vars, node=node, monotonic=clock),
        recorder=recorder,
        clock=clock,
        monotonic=clock,
    )
    try:
        while clock.now - T0 <= duration_seconds:
            snapshot = sampler.run_once()
            publication = store.latest()
            assert publication is not None
            yield clock.now, snapshot, publication
            clock.advance(interval_seconds)
    finally:
        sampler.stop()
        if recorder is not None:
            recorder.close()
