"""Per-process GPU memory: the compute processes NVML lists for each GPU, named from procfs, bounded.

The list is the one job attribution asks NVML for (one nvmlDeviceGetComputeRunningProcesses a GPU a
cycle, shared). A process's name is its /proc/PID/comm, read once per process: inside a container that
shows only with the host's PID namespace (hostPID), and is absent otherwise. Cardinality is bounded twice:
the `per_gpu` processes with most memory on each GPU, then the `per_node` with most memory over the node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from gpufleet.agent.attribution import read_regular
from gpufleet.agent.sample_parts import GpuProcess

DEFAULT_PER_GPU = 4
DEFAULT_PER_NODE = 32
_COMM_BYTES = 64  # the kernel's TASK_COMM_LEN is 16; more only guards against an odd procfs
_NOT_AVAILABLE = (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, slots=True)
class ComputeProcess:
    """One entry of nvmlDeviceGetComputeRunningProcesses, as the reader hands it on."""

    pid: int
    memory_used_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


def from_nvml(info: object) -> ComputeProcess:
    """A pynvml process entry (usedGpuMemory None or all ones where NVML lacks it; instance ids likewise)."""
    return ComputeProcess(
        int(info.pid),  # type: ignore[attr-defined]
        _known(getattr(info, "usedGpuMemory", None)),
        _known(getattr(info, "gpuInstanceId", None)),
        _known(getattr(info, "computeInstanceId", None)),
    )


def _known(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value in _NOT_AVAILABLE:
        return None
    return value


class ProcessTable:
    """Chooses which processes each GPU's sample carries, and names them; names are cached per live pid."""

    def __init__(self, procfs: str = "/proc", *, per_gpu: int = DEFAULT_PER_GPU, per_node: int = DEFAULT_PER_NODE):
        if per_gpu < 1 or per_node < 1:
            raise ValueError(f"per_gpu and per_node must be at least 1, got {per_gpu}, {per_node}")
        self._procfs = procfs
        self._per_gpu = per_gpu
        self._per_node = per_node
        self._names: dict[int, str | None] = {}

    def choose(
        self, listed: Mapping[int, tuple[ComputeProcess, ...]], jobs: Mapping[int, str | None]
    ) -> dict[int, tuple[GpuProcess, ...]]:
        """GPU index -> the processes its sample carries, each labelled with the GPU's job (`jobs`); names of
        pids no GPU lists any more are forgotten, as their ids may be reused."""
        chosen = self._choose(listed)
        live = {p.pid for _, p in chosen}
        self._names = {pid: name for pid, name in self._names.items() if pid in live}
        by_gpu: dict[int, list[GpuProcess]] = {}
        for index, p in chosen:
            process = GpuProcess(
                p.pid, p.memory_used_bytes, self._name(p.pid), jobs.get(index), p.gpu_instance_id, p.compute_instance_id
            )
            by_gpu.setdefault(index, []).append(process)
        return {index: tuple(processes) for index, processes in by_gpu.items()}

    def _choose(self, listed: Mapping[int, tuple[ComputeProcess, ...]]) -> list[tuple[int, ComputeProcess]]:
        """Top per GPU, then top over the node; by memory (unknown memory last), then pid for a stable order."""
        candidates = []
        for index, processes in listed.items():
            ranked = sorted(processes, key=_rank)
            candidates += [(index, p) for p in ranked[: self._per_gpu]]
        kept = sorted(candidates, key=lambda item: _rank(item[1]))[: self._per_node]
        return sorted(kept, key=lambda item: (item[0], _rank(item[1])))

    def _name(self, pid: int) -> str | None:
        if pid not in self._names:
            self._names[pid] = read_comm(self._procfs, pid)
        return self._names[pid]


def _rank(p: ComputeProcess) -> tuple[int, int]:
    return (-(p.memory_used_bytes if p.memory_used_bytes is not None else -1), p.pid)


def read_comm(procfs: str, pid: int) -> str | None:
    """The process's name from PROCFS/PID/comm; None where procfs does not show it."""
    try:
        raw = read_regular(os.path.join(procfs, str(pid), "comm"), _COMM_BYTES)
    except OSError:
        return None
    name = raw.decode("utf-8", "replace").strip()
    return name or None
