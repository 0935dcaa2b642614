"""The agent's immutable data model: one GpuSample per GPU, one NodeSnapshot per sampling cycle.

NodeSnapshot.to_dict() is the snapshot contract (schema 1): the agent->server wire format and the
trace format. Every reading a GPU or driver does not support is None here and null on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from gpufleet.reasons import CLOCK_CUT_REASONS, THERMAL_REASONS, ThrottleReason  # noqa: F401 - re-exported

SCHEMA_VERSION = 1

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one instant. None means the reading is unsupported (or failed) on this GPU.

    Each reading field is a row of agent.readings, which says how it is read and exported; the fields
    stay written out here so their types are checked (tests/agent/test_readings.py keeps the two in step).
    """

    index: int
    uuid: str
    model: str
    up: bool = True
    hpc_job: str | None = None
    # The Kubernetes pod of the GPU's processes, where there is one (see agent.attribution.Pod).
    kubernetes_namespace: str | None = None
    kubernetes_pod: str | None = None
    pci_bus_id: str | None = None
    serial: str | None = None
    vbios_version: str | None = None
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    # Free for allocation: total less used less what the driver reserves (which used leaves out).
    memory_free_bytes: int | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    slowdown_temperature_celsius: float | None = None
    shutdown_temperature_celsius: float | None = None
    max_operating_temperature_celsius: float | None = None
    memory_max_operating_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    memory_clock_hertz: float | None = None
    memory_clock_max_hertz: float | None = None
    throttle_reasons: int | None = None
    # Cumulative time spent in each throttle reason, keyed by ThrottleReason.label.
    throttle_seconds_total: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    nvlink_tx_bytes_total: int | None = None
    nvlink_rx_bytes_total: int | None = None
    # Per-link counters (flag-enabled extra); empty when disabled or unsupported.
    nvlink_link_tx_bytes_total: tuple[int | None, ...] = ()
    nvlink_link_rx_bytes_total: tuple[int | None, ...] = ()
    pcie_tx_bytes_total: int | None = None
    pcie_rx_bytes_total: int | None = None
    ecc_corrected_errors_total: int | None = None
    ecc_uncorrected_errors_total: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    xid_errors_total: int | None = None
    # XID events seen since the agent started, keyed by XID code.
    xid_errors_by_code: Mapping[int, int] = field(default_factory=lambda: _EMPTY)
    last_xid: int | None = None
    # Names of *_total fields that went backwards since the previous sample (driver reload, wrap).
    counter_resets: tuple[str, ...] = ()
    # Readings on a slow sampling tier that were not read in this cycle: seconds since they were, by
    # read unit, named after the first reading of its call (memory_used_bytes stands for memory_total_bytes
    # too, remapped_rows_correctable for all four remapped_rows_*); agent.tiers. A reading whose unit is
    # not named here was read in this cycle.
    slow_readings_age_seconds: Mapping[str, float] = field(default_factory=lambda: _EMPTY)

    def to_dict(self) -> dict[str, Any]:
        """The GPU's object in the snapshot contract."""
        out = {name: getattr(self, name) for name in _FIELDS}
        # Replacing a key's value keeps its place, so the JSON keeps the fields' order.
        for name in _MAPPING_FIELDS:
            value = getattr(self, name)
            out[name] = {str(k): v for k, v in value.items()} if value else {}
        for name in _TUPLE_FIELDS:
            out[name] = list(getattr(self, name))
        return out


# Which GpuSample fields need converting for JSON, decided once from the annotations rather than by an
# isinstance(..., Mapping) per field per sample (an ABC check, once the largest part of to_dict).
_MAPPING_FIELDS = tuple(n for n, t in GpuSample.__annotations__.items() if str(t).startswith("Mapping["))
_TUPLE_FIELDS = tuple(n for n, t in GpuSample.__annotations__.items() if str(t).startswith("tuple["))
_FIELDS = tuple(GpuSample.__annotations__)


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """Every GPU of one node at one sampling cycle; the unit the agent publishes and the server ingests."""

    node: str
    time: float
    gpus: tuple[GpuSample, ...]
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: str | None = None
    # Seconds the sampling cycle took (NVML calls plus attribution).
    sample_duration_seconds: float | None = None
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The snapshot contract, schema 1."""
        return {
            "schema": self.schema,
            "node": self.node,
            "time": self.time,
            "driver_version": self.driver_version,
            "nvml_version": self.nvml_version,
            "cuda_driver_version": self.cuda_driver_version,
            "sample_duration_seconds": self.sample_duration_seconds,
            "gpus": [g.to_dict() for g in self.gpus],
        }
