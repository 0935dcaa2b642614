"""Per-process GPU memory: which processes a sample carries (bounded per GPU and per node), their names from
procfs, one NVML process list per GPU shared with job attribution, and the metric family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gpufleet.agent.attribution import JobAttributor
from gpufleet.agent.cli import main
from gpufleet.agent.exposition import render, render_reference
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.processes import ComputeProcess, ProcessTable, from_nvml, read_comm
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.store import SnapshotStore
from tests.agent.fakes import FakeClock, StubReader
from tests.agent.test_mig import Counting

GIB = 1024**3
pytestmark = pytest.mark.usefixtures("restore_logging")


class Info:
    """What pynvml hands back for one process (a friendly object with these attributes)."""

    def __init__(self, pid: int, used: Any = None, gi: Any = 0xFFFFFFFF, ci: Any = 0xFFFFFFFF) -> None:
        self.pid, self.usedGpuMemory, self.gpuInstanceId, self.computeInstanceId = pid, used, gi, ci


def test_nvmls_not_available_values_become_none():
    assert from_nvml(Info(7, 5 * GIB, 3, 0)) == ComputeProcess(7, 5 * GIB, 3, 0)
    assert from_nvml(Info(7, None)) == ComputeProcess(7)
    assert from_nvml(Info(7, 0xFFFFFFFFFFFFFFFF)) == ComputeProcess(7)


def procfs(tmp_path: Path, names: dict[int, str]) -> str:
    for pid, name in names.items():
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / "comm").write_text(name + "\n")
    return str(tmp_path)


def test_the_largest_processes_per_gpu_then_per_node_are_kept(tmp_path):
    table = ProcessTable(procfs(tmp_path, {}), per_gpu=2, per_node=3)
    listed = {
        0: (ComputeProcess(10, 1 * GIB), ComputeProcess(11, 9 * GIB), ComputeProcess(12, 5 * GIB)),
        1: (ComputeProcess(20, 2 * GIB), ComputeProcess(21), ComputeProcess(22, 7 * GIB)),
    }
    out = table.choose(listed, {0: "42", 1: None})
    # Per GPU: 11 and 12 on GPU 0, 22 and 20 on GPU 1 (unknown memory last); over the node: the three largest.
    assert [p.pid for p in out[0]] == [11, 12]
    assert [p.pid for p in out[1]] == [22]
    assert [p.job for p in out[0]] == ["42", "42"] and out[1][0].job is None


def test_processes_are_named_from_comm_once_and_forgotten_when_gone(tmp_path):
    root = procfs(tmp_path, {10: "python3"})
    table = ProcessTable(root)
    first = table.choose({0: (ComputeProcess(10, GIB), ComputeProcess(11, GIB))}, {})
    assert [(p.pid, p.name) for p in first[0]] == [(10, "python3"), (11, None)]
    procfs(tmp_path, {10: "renamed"})
    assert table.choose({0: (ComputeProcess(10, GIB),)}, {})[0][0].name == "python3"
    assert table.choose({0: ()}, {}) == {}  # pid 10 ended; a new process may take its id
    assert table.choose({0: (ComputeProcess(10, GIB),)}, {})[0][0].name == "renamed"


def test_comm_that_is_not_a_regular_file_is_no_name(tmp_path):
    (tmp_path / "5" / "comm").mkdir(parents=True)
    assert read_comm(str(tmp_path), 5) is None
    assert read_comm(str(tmp_path), 6) is None


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        ProcessTable(per_gpu=0)


def test_a_reader_with_pids_alone_still_gives_processes_without_memory():
    reader = StubReader(gpus=2, pids={0: (100, 101)})
    sampler = Sampler(reader, SnapshotStore(), node="n", processes=ProcessTable("/nonexistent-procfs"))
    snap = sampler.run_once()
    assert [(p.pid, p.memory_used_bytes) for p in snap.gpus[0].processes] == [(100, None), (101, None)]
    assert "gpufleet_gpu_process_memory_used_bytes" not in render(snap, sampler.health()).decode()


def simulated(tmp_path: Path, *, table: bool) -> tuple[Any, Counting, Sampler]:
    clock = FakeClock()
    spec = load_scenario("hgx-h100")
    sim = SimNvml(spec, spec.nodes[0], clock=clock.time, epoch=clock.now - 120, block_on_events=False)
    sim.materialize_procfs(tmp_path)
    nvml = Counting(sim)
    reader = NvmlReader(nvml, clock=clock.time)
    attributor = JobAttributor(str(tmp_path), None, node=spec.nodes[0])
    processes = ProcessTable(str(tmp_path)) if table else None
    sampler = Sampler(reader, SnapshotStore(), node=spec.nodes[0], attributor=attributor, processes=processes)
    return sampler.run_once(), nvml, sampler


def test_one_process_list_per_gpu_serves_attribution_and_the_memory(tmp_path):
    snap, nvml, sampler = simulated(tmp_path, table=True)
    health = sampler.health()
    sampler.stop()
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 8
    for g in snap.gpus:
        (process,) = g.processes
        assert process.name == "python3" and process.job == g.hpc_job and g.hpc_job
        assert process.memory_used_bytes == g.memory_used_bytes
    body = render(snap, health)
    assert body == render_reference(snap, health)
    line = next(ln for ln in body.decode().splitlines() if ln.startswith("gpufleet_gpu_process_memory_used_bytes{"))
    for label in (
        'gpu="0"',
        f'pid="{snap.gpus[0].processes[0].pid}"',
        'process="python3"',
        f'job="{snap.gpus[0].hpc_job}"',
    ):
        assert label in line
    assert orjson.loads(orjson.dumps(snap.to_dict()))["gpus"][0]["processes"][0]["name"] == "python3"


def test_without_the_table_the_samples_carry_no_processes_and_nvml_is_asked_as_often(tmp_path):
    snap, nvml, sampler = simulated(tmp_path, table=False)
    sampler.stop()
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 8
    assert all(g.processes == () and g.hpc_job for g in snap.gpus)


def test_the_flags_bound_or_turn_off_the_processes(capsys):
    def once(*args: str) -> dict:
        assert main(["--once", "--log.level", "error", "--simulate", "hgx-h100", *args]) == 0
        return orjson.loads(capsys.readouterr().out)

    assert all(len(g["processes"]) == 1 and g["processes"][0]["job"] for g in once()["gpus"])
    assert sum(len(g["processes"]) for g in once("--metrics.processes-max", "3")["gpus"]) == 3
    assert all(g["processes"] == [] for g in once("--metrics.processes-per-gpu", "0")["gpus"])
    assert main(["--once", "--simulate", "hgx-h100", "--metrics.processes-per-gpu", "-1"]) == 2
    assert "processes-per-gpu" in capsys.readouterr().err


def test_the_node_cap_counts_processes_over_all_gpus():
    table = ProcessTable(per_gpu=4, per_node=5)
    listed = {i: tuple(ComputeProcess(100 * i + k, (i + k) * GIB) for k in range(4)) for i in range(3)}
    out = table.choose(listed, {})
    assert sum(len(processes) for processes in out.values()) == 5
    assert min(p.memory_used_bytes for processes in out.values() for p in processes) >= 3 * GIB
