"""The parts of a GpuSample that are lists of their own: its MIG GPU instances and its compute processes.

Immutable, as the sample is; each one's to_dict() is its object in the snapshot contract. Imports nothing
of the agent, so the model can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

_EMPTY: Mapping[str, float] = MappingProxyType({})
# Readings a MIG instance has of its own, under the GpuSample field names they stand beside.
_MEMORY = ("memory_used_bytes", "memory_total_bytes", "memory_free_bytes")


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG GPU instance (and its compute instance) of a GPU in MIG mode, at one sample.

    None: the driver did not give that value. `activity` holds the GPM readings the driver gives for the
    instance (nvmlGpmMigSampleGet), keyed by the GpuSample reading each stands beside (sm_active_ratio, ...).
    """

    gpu_instance_id: int
    compute_instance_id: int | None = None
    profile: str | None = None  # e.g. "1g.10gb", from the MIG device's name
    uuid: str | None = None  # MIG-..., what CUDA_VISIBLE_DEVICES names
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    activity: Mapping[str, float] = field(default_factory=lambda: _EMPTY)

    @property
    def memory_free_bytes(self) -> int | None:
        """Total less used, where both are known."""
        if self.memory_used_bytes is None or self.memory_total_bytes is None:
            return None
        return max(0, self.memory_total_bytes - self.memory_used_bytes)

    def value(self, reading: str) -> float | None:
        """The instance's value of a GpuSample reading, or None where an instance has no such value."""
        if reading in _MEMORY:
            value = getattr(self, reading)
            return None if value is None else float(value)
        return self.activity.get(reading)

    def to_dict(self) -> dict[str, Any]:
        """The instance's object in the snapshot contract."""
        return {
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
            "profile": self.profile,
            "uuid": self.uuid,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
            **self.activity,
        }


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One compute process on a GPU: what NVML lists, its name from procfs, and the job of the GPU."""

    pid: int
    memory_used_bytes: int | None = None  # None where NVML does not give it (no permission, WDDM)
    name: str | None = None  # /proc/PID/comm; None where procfs does not show the process (no hostPID)
    job: str | None = None
    gpu_instance_id: int | None = None  # the MIG instance it runs in, on a GPU in MIG mode
    compute_instance_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The process's object in the snapshot contract."""
        return {
            "pid": self.pid,
            "name": self.name,
            "job": self.job,
            "memory_used_bytes": self.memory_used_bytes,
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
        }
