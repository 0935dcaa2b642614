"""NVIDIA dcgm-exporter's series as snapshot-contract readings: names, labels and units, as data.

dcgm-exporter names a metric after its DCGM field (`DCGM_FI_DEV_GPU_TEMP`) and labels each GPU's series
`gpu` (index), `UUID`, `modelName`, `Hostname`, `pci_bus_id`, `device`, with `hpc_job` where HPC job
mapping is on and `namespace`/`pod`/`container` where Kubernetes pod mapping is. Its units are the
fields' own: %, MHz, MiB, mJ; the contract's are ratios, Hz, bytes, J.

What the shipped counter files (etc/default-counters.csv, etc/dcp-metrics-included.csv) leave out, a site
can add to its own file: the fields read beyond them are marked so in the reading table (server/readings.py,
DcgmField.shipped), and a detector that needs a reading no GPU has says what it cannot do
(MISSING_EFFECTS), once, where the source reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from gpufleet.server import readings
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


def dcgm_readings(table: tuple[readings.Reading, ...]) -> dict[str, Reading]:
    """dcgm-exporter metric -> how it is read, from the reading table's dcgm-exporter fields."""
    return {
        f.metric: Reading(r.name, f.scale, f.rank, counter=r.kind is readings.Kind.COUNTER)
        for r in table
        for f in r.dcgm
    }


READINGS: Mapping[str, Reading] = MappingProxyType(dcgm_readings(readings.READINGS))
BOOLS = frozenset(r.name for r in readings.READINGS if r.kind is readings.Kind.FLAG)

# contract label -> dcgm-exporter's label
NODE_LABEL = "Hostname"
UUID_LABEL = "UUID"
MODEL_LABEL = "modelName"
INDEX_LABEL = "gpu"
JOB_LABEL = "hpc_job"
# With Kubernetes pod mapping on and no hpc_job, the job is the pod's, by its name (gpufleet.podnames).
NAMESPACE_LABEL = "namespace"
POD_LABEL = "pod"

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
