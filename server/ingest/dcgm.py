"""NVIDIA dcgm-exporter's series as snapshot-contract readings: names, labels and units, as data.

dcgm-exporter names a metric after its DCGM field (`DCGM_FI_DEV_GPU_TEMP`) and labels each GPU's series
`gpu` (index), `UUID`, `modelName`, `Hostname`, `pci_bus_id`, `device`, with `hpc_job` where HPC job
mapping is on and `namespace`/`pod`/`container` where Kubernetes pod mapping is. Its units are the
fields' own: %, MHz, MiB, mJ; the contract's are ratios, Hz, bytes, J.

What the shipped counter files (etc/default-counters.csv, etc/dcp-metrics-included.csv) leave out, a site
can add to its own file: the fields read here beyond them are marked so below, and a detector that needs
a reading no GPU has says what it cannot do (MISSING_EFFECTS), once, where the source reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from gpufleet.server.engine import registry


@dataclass(frozen=True, slots=True)
class Reading:
    """One dcgm-exporter metric read as one contract field: value x scale, in the contract's unit."""

    field: str
    scale: float = 1.0
    # Where two metrics give one field, the higher rank wins (the finer reading, or the newer field name).
    rank: int = 0
    counter: bool = False  # grows without bound (energy, error counts): only 64-bit blanks apply

    def value(self, raw: float) -> float | None:
        """The reading in the contract's unit, or None where DCGM wrote a blank (unsupported) instead."""
        if raw != raw or raw >= (_BLANK_64 if self.counter else _BLANK_32):
            return None
        return raw * self.scale


# DCGM writes a reading it does not have (blank, not found, not supported, no permission) as a sentinel
# just below its type's maximum, which dcgm-exporter exports as that number: from 0x7ffffff0 for 32-bit
# integers, from 2**47 for doubles, from 0x7ffffffffffffff0 for 64-bit integers (a GPU without an HBM
# sensor reads DCGM_FI_DEV_MEMORY_TEMP 9223372036854775794). Every gauge read here is far below 0x7ffffff0;
# the counters can pass it, but not 2**47 (mJ: 700 W for six years).
_BLANK_32 = float(0x7FFFFFF0)
_BLANK_64 = float(2**47)


READINGS: Mapping[str, Reading] = {
    "DCGM_FI_DEV_GPU_TEMP": Reading("temperature_celsius"),
    "DCGM_FI_DEV_MEMORY_TEMP": Reading("memory_temperature_celsius"),
    "DCGM_FI_DEV_POWER_USAGE": Reading("power_watts"),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": Reading("energy_joules_total", 1e-3, counter=True),  # mJ
    "DCGM_FI_DEV_SM_CLOCK": Reading("sm_clock_hertz", 1e6),  # MHz
    "DCGM_FI_DEV_GPU_UTIL": Reading("utilization_ratio", 1e-2),  # %
    # The share of time any kernel ran, from the profiling counters: NVML's utilization at a finer grain.
    # Not SM activity: a GPU waiting in a collective runs NCCL's kernel and reads busy, so taken as SM
    # activity it would hide every straggler's waiting peers.
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": Reading("utilization_ratio", rank=1),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": Reading("remapped_rows_failure"),
    # The code of the last XID (0: none yet), a gauge: a new code is seen, the same code again is not.
    "DCGM_FI_DEV_XID_ERRORS": Reading("last_xid"),
    # Not in the shipped counter files from here on.
    "DCGM_FI_PROF_SM_ACTIVE": Reading("sm_active_ratio"),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": Reading("remapped_rows_pending"),
    "DCGM_FI_DEV_SLOWDOWN_TEMP": Reading("slowdown_temperature_celsius"),
    "DCGM_FI_DEV_MEM_MAX_OP_TEMP": Reading("memory_max_operating_temperature_celsius"),
    "DCGM_FI_DEV_MAX_SM_CLOCK": Reading("sm_clock_max_hertz", 1e6),  # MHz
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": Reading("power_limit_watts"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": Reading("ecc_uncorrected_errors_total", counter=True),
    # NVML's clocks-event (throttle) reasons bitmask, under DCGM's name before and after 3.3.
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": Reading("throttle_reasons"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": Reading("throttle_reasons", rank=1),
}
BOOLS = frozenset({"remapped_rows_failure", "remapped_rows_pending"})

# contract label -> dcgm-exporter's label
NODE_LABEL = "Hostname"
UUID_LABEL = "UUID"
MODEL_LABEL = "modelName"
INDEX_LABEL = "gpu"
JOB_LABEL = "hpc_job"

# reading -> ((alert kind, what it cannot do without the reading), ...), for a source where no GPU has it:
# each detector declares what its kinds need (KindSpec.without), so this follows the detectors the server runs.
MISSING_EFFECTS: Mapping[str, tuple[tuple[str, str], ...]] = registry.missing_effects(registry.STANDARD)


def metrics_for(field: str) -> tuple[str, ...]:
    """The dcgm-exporter metrics that give a contract field."""
    return tuple(name for name, reading in READINGS.items() if reading.field == field)


def missing_effects(seen_fields: frozenset[str]) -> tuple[tuple[str, str, str], ...]:
    """(reading, detector, effect) for every reading in MISSING_EFFECTS that no GPU has."""
    return tuple(
        (reading, detector, effect)
        for reading, effects in MISSING_EFFECTS.items()
        if reading not in seen_fields
        for detector, effect in effects
    )
