"""The agent's readings as one table: what each is read from, how often, in which unit, and how it is exported.

A reading is one value per GPU that the agent takes from NVML and publishes in its snapshot (a
`GpuSample` field of the same name) and on /metrics. Each row of READINGS says where the raw value
comes from (an entry of the field-value batch, a part of an NVML call's answer, a GPM metric), whether a
detector needs it fresh (its sampling tier, agent.tiers), how the raw number becomes the model's value
(agent.nvml_values), whether a card without NVLink lacks it, and which metric family and label value
export it. The field-value batch (agent.nvml_fields), the calls (agent.nvml_calls), GPM (agent.gpm),
the tiers, the conversions and the exposition (agent.exposition) are built from it. The rows are in the
order the agent reads them: the field-value batch, the polled calls, the limits read at open, GPM, then
XID; a family's series are written in row order. The families are written in FAMILIES' order, then
those rows declare themselves.

Imports nothing of the agent: it is data, upstream of everything that reads NVML or writes a metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Literal, Mapping

ALL_LINKS = 0xFFFFFFFF  # scope id that asks NVLink fields for the sum over all links


# --- the unit conversion and sanity check ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    """How to turn one raw NVML number into a model value: raw * mul / div, then bounds (integer: no div)."""

    mul: int = 1
    div: int = 1
    low: float = 0.0
    high: float = math.inf
    integer: bool = False
    counter: bool = False
    flag: bool = False


RATIO = Rule(div=100, high=1.0)  # percent 0-100 -> 0-1
TEMPERATURE = Rule(low=-40.0, high=150.0)
POWER = Rule(div=1000, high=5000.0)  # mW -> W, at most 5 kW
CLOCK = Rule(mul=1_000_000, high=5e9)  # MHz -> Hz, at most 5 GHz
# GDDR cards report the memory data rate as their memory clock (an L40S says 9001 MHz, GDDR7 ~15 GHz).
MEMORY_CLOCK = Rule(mul=1_000_000, high=40e9)
COUNT = Rule(integer=True)
COUNTER = Rule(integer=True, counter=True)
KIB_COUNTER = Rule(mul=1024, integer=True, counter=True)  # KiB -> bytes
FLAG = Rule(flag=True)


# --- where the raw value comes from -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldValue:
    """An entry of the per-poll nvmlDeviceGetFieldValues batch: a field id (pynvml's constant) and scope."""

    field_id: str
    scope: int = 0


@dataclass(frozen=True, slots=True)
class PerLinkField:
    """A field asked once per NVLink link (the scope is the link), with --nvlink.per-link; a tuple field."""

    field_id: str


@dataclass(frozen=True, slots=True)
class NvmlCall:
    """A device call `function(handle, *args, **kwargs)`, args and kwargs named by pynvml constant.

    Rows naming the same call are filled by one call per read; `part` picks a row's value from the answer
    (an attribute name, or an index into a tuple); None: the answer is the value. `at_open`: a limit
    that does not change while the driver runs, read when NVML opens (and retried while unread).
    """

    function: str
    args: tuple[str, ...] = ()
    part: str | int | None = None
    kwargs: tuple[tuple[str, str], ...] = ()
    at_open: bool = False

    @property
    def call(self) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], bool]:
        """What tells one call from another: rows equal here share one call."""
        return self.function, self.args, self.kwargs, self.at_open


@dataclass(frozen=True, slots=True)
class GpmMetric:
    """A GPM metric (pynvml's NVML_GPM_METRIC_* constant), averaged between two polls (agent.gpm)."""

    metric_id: str


class Own(Enum):
    """Readings whose source has a module of its own."""

    THROTTLE_FIELDS = "throttle"  # one field per clocks-event reason (agent.nvml_fields), a mapping by reason
    XID_EVENTS = "xid"  # counted from NVML's event set on the XID thread (agent.xid)


Source = FieldValue | PerLinkField | NvmlCall | GpmMetric | Own


# --- how it is exported --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """A per-GPU metric family; `label` tells apart the readings it carries (their rows' `label_value`).

    Counter names leave out _total, as prometheus_client's families do; the writer appends it.
    """

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    label: str = ""


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


# --- the rows ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reading:
    """One snapshot reading: its GpuSample field, source, conversion, tier and series."""

    name: str
    source: Source
    rule: Rule
    # The family of its series (a FAMILIES name, or a Family of its own declared here) and its label
    # value; None: exported by a family agent.exposition writes itself.
    family: str | Family | None = None
    label_value: str = ""
    # A detector acts on it: read at least every tiers.FAST_MAX_AGE_S, whatever the CPU budget.
    fast: bool = False
    # Absent, not 0, on a GPU without NVLink (NVML answers these with zeros there).
    nvlink: bool = False


def _threshold(name: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetTemperatureThreshold", (name,), at_open=True)


def _ecc(error_type: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetTotalEccErrors", (error_type, "NVML_VOLATILE_ECC"))


_UTILIZATION = "nvmlDeviceGetUtilizationRates"
_MEMORY = ("nvmlDeviceGetMemoryInfo", (("version", "nvmlMemory_v2"),))
_REMAPPED = "nvmlDeviceGetRemappedRows"  # (correctable, uncorrectable, pending, failure)
_CLOCK_INFO = "nvmlDeviceGetClockInfo"
_MAX_CLOCK = "nvmlDeviceGetMaxClockInfo"

READINGS: tuple[Reading, ...] = (
    # The field-value batch, one call per GPU per poll (its first entry carries the call's own cost).
    Reading("power_watts", FieldValue("NVML_FI_DEV_POWER_INSTANT"), POWER, "gpufleet_gpu_power_watts", fast=True),
    Reading(
        "energy_joules_total",
        FieldValue("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
        Rule(div=1000, counter=True),  # mJ -> J
        "gpufleet_gpu_energy_joules",
    ),
    Reading(
        "memory_temperature_celsius",
        FieldValue("NVML_FI_DEV_MEMORY_TEMP"),
        TEMPERATURE,
        "gpufleet_gpu_memory_temperature_celsius",
        fast=True,
    ),
    Reading(
        "pcie_tx_bytes_total", FieldValue("NVML_FI_DEV_PCIE_COUNT_TX_BYTES"), COUNTER, "gpufleet_gpu_pcie_bytes", "tx"
    ),
    Reading(
        "pcie_rx_bytes_total", FieldValue("NVML_FI_DEV_PCIE_COUNT_RX_BYTES"), COUNTER, "gpufleet_gpu_pcie_bytes", "rx"
    ),
    Reading(
        "nvlink_tx_bytes_total",
        FieldValue("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", ALL_LINKS),
        KIB_COUNTER,
        "gpufleet_gpu_nvlink_bytes",
        "tx",
        nvlink=True,
    ),
    Reading(
        "nvlink_rx_bytes_total",
        FieldValue("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", ALL_LINKS),
        KIB_COUNTER,
        "gpufleet_gpu_nvlink_bytes",
        "rx",
        nvlink=True,
    ),
    Reading("throttle_seconds_total", Own.THROTTLE_FIELDS, Rule(div=1_000_000_000, counter=True)),  # ns -> s
    Reading("nvlink_link_tx_bytes_total", PerLinkField("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"), KIB_COUNTER),
    Reading("nvlink_link_rx_bytes_total", PerLinkField("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"), KIB_COUNTER),
    # Calls on every poll, in the order they are made.
    Reading(
        "utilization_ratio",
        NvmlCall(_UTILIZATION, part="gpu"),
        RATIO,
        "gpufleet_gpu_utilization_ratio",
        fast=True,
    ),
    Reading(
        "memory_utilization_ratio",
        NvmlCall(_UTILIZATION, part="memory"),
        RATIO,
        "gpufleet_gpu_memory_utilization_ratio",
    ),
    Reading(
        "temperature_celsius",
        NvmlCall("nvmlDeviceGetTemperatureV", ("NVML_TEMPERATURE_GPU",)),
        TEMPERATURE,
        "gpufleet_gpu_temperature_celsius",
        fast=True,
    ),
    Reading(
        "sm_clock_hertz",
        NvmlCall(_CLOCK_INFO, ("NVML_CLOCK_SM",)),
        CLOCK,
        "gpufleet_gpu_clock_hertz",
        "sm",
        fast=True,
    ),
    Reading(
        "memory_clock_hertz",
        NvmlCall(_CLOCK_INFO, ("NVML_CLOCK_MEM",)),
        MEMORY_CLOCK,
        "gpufleet_gpu_clock_hertz",
        "memory",
        fast=True,
    ),
    Reading(
        "throttle_reasons",
        NvmlCall("nvmlDeviceGetCurrentClocksEventReasons"),
        COUNT,
        "gpufleet_gpu_throttle_reasons",
        fast=True,
    ),
    Reading(
        "memory_used_bytes",
        NvmlCall(_MEMORY[0], part="used", kwargs=_MEMORY[1]),
        COUNT,
        "gpufleet_gpu_memory_used_bytes",
    ),
    Reading(
        "memory_total_bytes",
        NvmlCall(_MEMORY[0], part="total", kwargs=_MEMORY[1]),
        COUNT,
        "gpufleet_gpu_memory_total_bytes",
    ),
    Reading(
        "memory_free_bytes",
        NvmlCall(_MEMORY[0], part="free", kwargs=_MEMORY[1]),
        COUNT,
        "gpufleet_gpu_memory_free_bytes",
    ),
    # Operators change power caps at run time, so the limit is polled too.
    Reading(
        "power_limit_watts",
        NvmlCall("nvmlDeviceGetEnforcedPowerLimit"),
        POWER,
        "gpufleet_gpu_power_limit_watts",
    ),
    Reading(
        "ecc_corrected_errors_total",
        _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED"),
        COUNTER,
        "gpufleet_gpu_ecc_errors",
        "corrected",
    ),
    Reading(
        "ecc_uncorrected_errors_total",
        _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
        COUNTER,
        "gpufleet_gpu_ecc_errors",
        "uncorrected",
    ),
    Reading(
        "remapped_rows_correctable",
        NvmlCall(_REMAPPED, part=0),
        COUNT,
        "gpufleet_gpu_remapped_rows",
        "correctable",
    ),
    Reading(
        "remapped_rows_uncorrectable",
        NvmlCall(_REMAPPED, part=1),
        COUNT,
        "gpufleet_gpu_remapped_rows",
        "uncorrectable",
    ),
    Reading("remapped_rows_pending", NvmlCall(_REMAPPED, part=2), FLAG, "gpufleet_gpu_remapped_rows_pending"),
    Reading("remapped_rows_failure", NvmlCall(_REMAPPED, part=3), FLAG, "gpufleet_gpu_remapped_rows_failure"),
    # Limits read once at open.
    Reading(
        "slowdown_temperature_celsius",
        _threshold("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "slowdown",
    ),
    Reading(
        "shutdown_temperature_celsius",
        _threshold("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "shutdown",
    ),
    Reading(
        "max_operating_temperature_celsius",
        _threshold("NVML_TEMPERATURE_THRESHOLD_GPU_MAX"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "max_operating",
    ),
    Reading(
        "memory_max_operating_temperature_celsius",
        _threshold("NVML_TEMPERATURE_THRESHOLD_MEM_MAX"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "memory_max_operating",
    ),
    Reading(
        "sm_clock_max_hertz",
        NvmlCall(_MAX_CLOCK, ("NVML_CLOCK_SM",), at_open=True),
        CLOCK,
        "gpufleet_gpu_clock_max_hertz",
        "sm",
    ),
    Reading(
        "memory_clock_max_hertz",
        NvmlCall(_MAX_CLOCK, ("NVML_CLOCK_MEM",), at_open=True),
        MEMORY_CLOCK,
        "gpufleet_gpu_clock_max_hertz",
        "memory",
    ),
    # GPM: SM activity and occupancy between two polls.
    Reading("sm_active_ratio", GpmMetric("NVML_GPM_METRIC_SM_UTIL"), RATIO, "gpufleet_gpu_sm_active_ratio", fast=True),
    Reading("sm_occupancy_ratio", GpmMetric("NVML_GPM_METRIC_SM_OCCUPANCY"), RATIO, "gpufleet_gpu_sm_occupancy_ratio"),
    # XID events (the count by code and the last code are the XID watcher's own fields).
    Reading("xid_errors_total", Own.XID_EVENTS, COUNTER),
)

BY_NAME: Mapping[str, Reading] = MappingProxyType({r.name: r for r in READINGS})


def family_name(reading: Reading) -> str | None:
    """The name of the family a reading's series is in, however the row gives it."""
    family = reading.family
    return family.name if isinstance(family, Family) else family


def exported_families() -> tuple[Family, ...]:
    """Every family of the table in its order on /metrics: FAMILIES, then those rows declare themselves."""
    own = {r.family.name: r.family for r in READINGS if isinstance(r.family, Family)}
    return FAMILIES + tuple(f for name, f in own.items() if name not in {g.name for g in FAMILIES})
