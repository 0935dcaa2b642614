"""The agent's readings as one table, gathered from the rows their `GpuSample` fields carry.

A reading is one value per GPU that the agent takes from NVML and publishes in its snapshot (a
`GpuSample` field) and on /metrics. Its row sits on that field (agent.model, `reading(...)`; the row's
vocabulary is agent.reading_row) and says where the raw value comes from (an entry of the field-value
batch, a part of an NVML call's answer, a GPM metric), whether a detector needs it fresh (its sampling
tier, agent.tiers), how the raw number becomes the model's value (agent.nvml_values), whether a card
without NVLink lacks it, and which metric family and label value export it. The field-value batch
(agent.nvml_fields), the calls (agent.nvml_calls), GPM (agent.gpm), the tiers, the conversions and the
exposition (agent.exposition) are built from READINGS. The rows are in the snapshot's field order, and
each reader takes its own kind in that order: the batch's entries, the calls (in the order of each
call's first row), a family's series. The families are written in FAMILIES' order, then those rows
declare themselves.

Imports only the model and the row vocabulary: it is data, upstream of everything that reads NVML or
writes a metric.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from gpufleet.agent.model import GpuSample
from gpufleet.agent.reading_row import (  # noqa: F401 - the row vocabulary, re-exported for the table's readers
    ALL_LINKS,
    Family,
    FieldValue,
    GpmMetric,
    NvmlCall,
    Own,
    PerLinkField,
    Rule,
    Source,
    row_of,
)

# The per-GPU families rows name, in their order on /metrics; a family a row declares itself comes
# after them, in row order. Families of readings keyed by reason, link or XID code are written by
# agent.exposition itself.
FAMILIES: tuple[Family, ...] = (
    Family(
        "gpufleet_gpu_utilization_ratio", "gauge", "Share of time any kernel ran on the GPU (NVML utilization), 0-1."
    ),
    Family("gpufleet_gpu_memory_utilization_ratio", "gauge", "Share of time device memory was read or written, 0-1."),
    Family("gpufleet_gpu_sm_active_ratio", "gauge", "GPM SM activity: share of SM time with a warp resident, 0-1."),
    Family("gpufleet_gpu_sm_occupancy_ratio", "gauge", "GPM SM occupancy: resident warps over the maximum, 0-1."),
    Family(
        "gpufleet_gpu_memory_used_bytes",
        "gauge",
        "Device memory allocated (NVML used). Leaves out the memory the driver "
        "reserves, which memory_total_bytes includes: free memory is memory_free_bytes, not total - used.",
    ),
    Family(
        "gpufleet_gpu_memory_free_bytes",
        "gauge",
        "Device memory free for allocation (NVML free): total less used less the driver's reserved memory.",
    ),
    Family(
        "gpufleet_gpu_memory_total_bytes", "gauge", "Device memory in total, the driver's reserved memory included."
    ),
    Family("gpufleet_gpu_temperature_celsius", "gauge", "GPU die temperature."),
    Family("gpufleet_gpu_memory_temperature_celsius", "gauge", "HBM temperature."),
    Family("gpufleet_gpu_power_watts", "gauge", "Instantaneous power draw."),
    Family("gpufleet_gpu_power_limit_watts", "gauge", "Enforced power limit."),
    Family(
        "gpufleet_gpu_throttle_reasons",
        "gauge",
        "NVML clocks-event (throttle) reasons bitmask, as reported; one series "
        "per named reason is gpufleet_gpu_throttle_active.",
    ),
    Family("gpufleet_gpu_temperature_limit_celsius", "gauge", "Temperature thresholds the device reports.", "limit"),
    Family("gpufleet_gpu_clock_hertz", "gauge", "Current clock frequency.", "clock"),
    Family("gpufleet_gpu_clock_max_hertz", "gauge", "Maximum clock frequency.", "clock"),
    Family("gpufleet_gpu_energy_joules", "counter", "Energy consumed since the driver loaded."),
    Family("gpufleet_gpu_nvlink_bytes", "counter", "NVLink data bytes over all links.", "direction"),
    Family("gpufleet_gpu_pcie_bytes", "counter", "PCIe bytes.", "direction"),
    Family("gpufleet_gpu_ecc_errors", "counter", "Volatile ECC errors since the driver loaded.", "type"),
    Family("gpufleet_gpu_remapped_rows", "gauge", "Rows remapped for ECC errors.", "type"),
    Family("gpufleet_gpu_remapped_rows_pending", "gauge", "1 when a row remap waits for a GPU reset."),
    Family("gpufleet_gpu_remapped_rows_failure", "gauge", "1 when a row remap failed."),
)


@dataclass(frozen=True, slots=True)
class Reading:
    """One snapshot reading: its GpuSample field's name and the row that field carries."""

    name: str
    source: Source
    rule: Rule
    family: str | Family | None = None
    label_value: str = ""
    fast: bool = False
    nvlink: bool = False


def _gather() -> tuple[Reading, ...]:
    """Every GpuSample field that carries a row, in field order."""
    out = []
    for field in dataclasses.fields(GpuSample):
        row = row_of(field)
        if row is not None:
            out.append(Reading(field.name, row.source, row.rule, row.family, row.label_value, row.fast, row.nvlink))
    return tuple(out)


READINGS: tuple[Reading, ...] = _gather()

BY_NAME: Mapping[str, Reading] = MappingProxyType({r.name: r for r in READINGS})


def family_name(reading: Reading) -> str | None:
    """The name of the family a reading's series is in, however the row gives it."""
    family = reading.family
    return family.name if isinstance(family, Family) else family


def exported_families() -> tuple[Family, ...]:
    """Every family of the table in its order on /metrics: FAMILIES, then those rows declare themselves."""
    own = {r.family.name: r.family for r in READINGS if isinstance(r.family, Family)}
    return FAMILIES + tuple(f for name, f in own.items() if name not in {g.name for g in FAMILIES})
