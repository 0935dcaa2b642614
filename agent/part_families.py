"""The metric rows of a GPU's MIG instances and compute processes, for agent.exposition and agent.dcgm_names.

Imports no NVML binding (the exposition runs where nvidia-ml-py is missing, to say so). Rows only (label names, label values, value): the exposition modules wrap them in their families, so this
module imports neither. Labels a part lacks (a profile the driver did not name, a process procfs does not
show) are left out of its series, as an absent label is in Prometheus.
"""

from __future__ import annotations

from typing import Iterator, Mapping

from gpufleet.agent.model import GpuSample
from gpufleet.agent.readings import READINGS, GpmMetric
from gpufleet.agent.sample_parts import MigInstance

Row = tuple[tuple[str, ...], tuple[str, ...], float]
# (family name, kind, help, rows)
FamilyRows = tuple[str, str, str, list[Row]]
Ids = Mapping[int, tuple[str, ...]]

_MIG_MEMORY = (
    ("memory_used_bytes", "gpufleet_mig_memory_used_bytes", "Memory used in the MIG GPU instance (NVML used)."),
    ("memory_total_bytes", "gpufleet_mig_memory_total_bytes", "Memory of the MIG GPU instance (NVML total)."),
)
_MIG_ACTIVITY = tuple(
    (r, f"gpufleet_mig_{r}", f"GPM {r.removesuffix('_ratio').replace('_', ' ')} of the MIG GPU instance, 0-1.")
    for r in (r.name for r in READINGS if isinstance(r.source, GpmMetric))
)
MIG_FAMILIES = tuple(name for _, name, _ in _MIG_MEMORY + _MIG_ACTIVITY)


def mig_families(gpus: tuple[GpuSample, ...], ids: Ids, gpu_labels: tuple[str, ...]) -> Iterator[FamilyRows]:
    """gpufleet_gpu_mig_enabled, then one family per instance reading (memory, GPM activity)."""
    enabled: list[Row] = [(gpu_labels, ids[g.index], float(g.mig_enabled)) for g in gpus if g.mig_enabled is not None]
    yield (
        "gpufleet_gpu_mig_enabled",
        "gauge",
        "1 while the GPU is in MIG mode, 0 where it could be and is not.",
        enabled,
    )
    for reading, name, help_text in _MIG_MEMORY + _MIG_ACTIVITY:
        rows: list[Row] = []
        for g in gpus:
            for instance in g.mig_instances:
                value = instance.value(reading)
                if value is not None:
                    names, values = _instance_labels(instance)
                    rows.append((gpu_labels + names, ids[g.index] + values, value))
        yield (name, "gauge", help_text, rows)


def _instance_labels(i: MigInstance) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pairs = (
        ("gpu_instance", str(i.gpu_instance_id)),
        ("compute_instance", None if i.compute_instance_id is None else str(i.compute_instance_id)),
        ("profile", i.profile),
        ("mig_uuid", i.uuid),
    )
    present = [(k, v) for k, v in pairs if v]
    return tuple(k for k, _ in present), tuple(v for _, v in present if v)


def process_family(gpus: tuple[GpuSample, ...], ids: Ids, gpu_labels: tuple[str, ...]) -> FamilyRows:
    """gpufleet_gpu_process_memory_used_bytes: one series per process the samples carry."""
    rows: list[Row] = []
    for g in gpus:
        for p in g.processes:
            if p.memory_used_bytes is None:
                continue
            pairs = (
                ("pid", str(p.pid)),
                ("process", p.name),
                ("job", p.job),
                ("gpu_instance", None if p.gpu_instance_id is None else str(p.gpu_instance_id)),
            )
            present = [(k, v) for k, v in pairs if v]
            names = gpu_labels + tuple(k for k, _ in present)
            rows.append((names, ids[g.index] + tuple(v for _, v in present if v), float(p.memory_used_bytes)))
    help_text = (
        "GPU memory a compute process uses, for the processes with most memory on each GPU "
        "(--metrics.processes-per-gpu, --metrics.processes-max); process: its name in procfs."
    )
    return ("gpufleet_gpu_process_memory_used_bytes", "gauge", help_text, rows)


def dcgm_instance_rows(
    g: GpuSample, names: tuple[str, ...], values: tuple[str, ...], reading: str, scale: float
) -> list[Row]:
    """dcgm-exporter's per-instance series of one field: the GPU's labels and GPU_I_ID, GPU_I_PROFILE."""
    rows: list[Row] = []
    for i in g.mig_instances:
        value = i.value(reading)
        if value is None:
            continue
        extra = (("GPU_I_ID", str(i.gpu_instance_id)),) + ((("GPU_I_PROFILE", i.profile),) if i.profile else ())
        rows.append((names + tuple(k for k, _ in extra), values + tuple(v for _, v in extra), value * scale))
    return rows
