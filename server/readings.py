"""The readings the server uses, one row each: the one list of what it decodes, checks, keeps and maps.

Everything else is derived from READINGS once, at import: the snapshot contract's columns, range checks
and decoding order (server/contract.py), the windows' binned rows, held limits and counters
(server/engine/windows.py), and which series give each reading when it is read from Prometheus: the
agents' (server/ingest/prometheus.py) and dcgm-exporter's (server/ingest/dcgm.py). Adding a reading the
server uses is a row here; CONTRIBUTING.md ("Add a reading") lists the agent's side.

Rows are in the order the agent writes the fields (agent/model.py, GpuSample): the decoder finds each
key fastest right after the previous one, and the contract's matrix columns follow the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    """What sort of number a reading is, which decides how it is decoded and how a blank is told."""

    LEVEL = "level"  # a gauge: what the GPU reads at the sample
    COUNTER = "counter"  # cumulative since the driver loaded: its increases count, a drop is a reset
    FLAG = "flag"  # yes or no, decoded as a bool
    BITMASK = "bitmask"  # flags packed into an integer (NVML's clocks-event reasons)


class Window(Enum):
    """What the engine's windows keep of a reading."""

    NONE = "none"  # nothing of its own: the windows' derived rows read it (clock ratio, throttle bits)
    ROW = "row"  # its mean per tick bin, one row of the rings (server.engine.windows.ROW[name])
    HELD = "held"  # a device constant (a temperature limit): the newest value per GPU
    EVENTS = "events"  # a health counter: every increase is a CounterEvent of the row's `event` kind


@dataclass(frozen=True, slots=True)
class AgentSeries:
    """The agent's exposition series that gives a reading: the metric (`_total` included for a counter)
    and, where one metric carries several readings, the label and value that tell them apart."""

    metric: str
    label: str | None = None
    value: str | None = None


@dataclass(frozen=True, slots=True)
class DcgmField:
    """One dcgm-exporter metric that gives a reading: its value x scale is in the reading's unit; where
    two metrics give one reading, the higher rank wins (the finer reading, or the newer field name)."""

    metric: str
    scale: float = 1.0
    rank: int = 0
    # In dcgm-exporter's shipped counter files (etc/default-counters.csv, etc/dcp-metrics-included.csv);
    # a site adds the others to its own file.
    shipped: bool = True


@dataclass(frozen=True, slots=True)
class Reading:
    """One reading of one GPU as the server uses it."""

    name: str  # the contract's field name, its unit in it
    unit: str  # empty for a flag, a bitmask or a code
    kind: Kind
    # Plausible range: a value outside it is a broken agent, refused with the snapshot. Flags have none.
    limits: tuple[float, float] | None = None
    window: Window = Window.NONE
    event: str | None = None  # CounterEvent.kind of a Window.EVENTS counter
    clamp: float | None = None  # values above are read as this (a ratio a driver rounds over 1)
    agent: AgentSeries | None = None
    # The `reading` label of the agent's `active` counters whose increases give this reading's exact
    # mean between two scrapes (server/ingest/prometheus.py).
    activity: str | None = None
    dcgm: tuple[DcgmField, ...] = ()


_RATIO = (0.0, 1.5)
_CELSIUS = (-60.0, 250.0)
_WATTS = (0.0, 10_000.0)
_HERTZ = (0.0, 1e11)
_GPU = "gpufleet_gpu_"

READINGS: tuple[Reading, ...] = (
    Reading("up", "", Kind.FLAG, window=Window.ROW, agent=AgentSeries(_GPU + "up")),
    Reading(
        "utilization_ratio",
        "ratio",
        Kind.LEVEL,
        _RATIO,
        Window.ROW,
        clamp=1.0,
        agent=AgentSeries(_GPU + "utilization_ratio"),
        activity="utilization",
        # GR_ENGINE_ACTIVE is the share of time any kernel ran, from the profiling counters: NVML's
        # utilization at a finer grain. Not SM activity: a GPU waiting in a collective runs NCCL's kernel
        # and reads busy, so taken as SM activity it would hide every straggler's waiting peers.
        dcgm=(DcgmField("DCGM_FI_DEV_GPU_UTIL", 1e-2), DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", rank=1)),
    ),
    Reading(
        "sm_active_ratio",
        "ratio",
        Kind.LEVEL,
        _RATIO,
        Window.ROW,
        clamp=1.0,
        agent=AgentSeries(_GPU + "sm_active_ratio"),
        activity="sm_active",
        dcgm=(DcgmField("DCGM_FI_PROF_SM_ACTIVE", shipped=False),),
    ),
    Reading(
        "temperature_celsius",
        "celsius",
        Kind.LEVEL,
        _CELSIUS,
        Window.ROW,
        agent=AgentSeries(_GPU + "temperature_celsius"),
        dcgm=(DcgmField("DCGM_FI_DEV_GPU_TEMP"),),
    ),
    Reading(
        "memory_temperature_celsius",
        "celsius",
        Kind.LEVEL,
        _CELSIUS,
        Window.ROW,
        agent=AgentSeries(_GPU + "memory_temperature_celsius"),
        dcgm=(DcgmField("DCGM_FI_DEV_MEMORY_TEMP"),),
    ),
    Reading(
        "slowdown_temperature_celsius",
        "celsius",
        Kind.LEVEL,
        _CELSIUS,
        Window.HELD,
        agent=AgentSeries(_GPU + "temperature_limit_celsius", "limit", "slowdown"),
        dcgm=(DcgmField("DCGM_FI_DEV_SLOWDOWN_TEMP", shipped=False),),
    ),
    Reading(
        "memory_max_operating_temperature_celsius",
        "celsius",
        Kind.LEVEL,
        _CELSIUS,
        Window.HELD,
        agent=AgentSeries(_GPU + "temperature_limit_celsius", "limit", "memory_max_operating"),
        dcgm=(DcgmField("DCGM_FI_DEV_MEM_MAX_OP_TEMP", shipped=False),),
    ),
    Reading(
        "power_watts",
        "watts",
        Kind.LEVEL,
        _WATTS,
        Window.ROW,
        agent=AgentSeries(_GPU + "power_watts"),
        dcgm=(DcgmField("DCGM_FI_DEV_POWER_USAGE"),),
    ),
    Reading(
        "power_limit_watts",
        "watts",
        Kind.LEVEL,
        _WATTS,
        Window.ROW,
        agent=AgentSeries(_GPU + "power_limit_watts"),
        dcgm=(DcgmField("DCGM_FI_DEV_POWER_MGMT_LIMIT", shipped=False),),
    ),
    # The windows difference it into the average power between samples (their B_POWER row).
    Reading(
        "energy_joules_total",
        "joules",
        Kind.COUNTER,
        (0.0, 1e18),
        agent=AgentSeries(_GPU + "energy_joules_total"),
        dcgm=(DcgmField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1e-3),),  # mJ
    ),
    Reading(
        "sm_clock_hertz",
        "hertz",
        Kind.LEVEL,
        _HERTZ,
        agent=AgentSeries(_GPU + "clock_hertz", "clock", "sm"),
        dcgm=(DcgmField("DCGM_FI_DEV_SM_CLOCK", 1e6),),  # MHz
    ),
    Reading(
        "sm_clock_max_hertz",
        "hertz",
        Kind.LEVEL,
        _HERTZ,
        agent=AgentSeries(_GPU + "clock_max_hertz", "clock", "sm"),
        dcgm=(DcgmField("DCGM_FI_DEV_MAX_SM_CLOCK", 1e6, shipped=False),),  # MHz
    ),
    # NVML's clocks-event (throttle) reasons, under DCGM's name before and after 3.3.
    Reading(
        "throttle_reasons",
        "",
        Kind.BITMASK,
        (0.0, 2.0**64),
        agent=AgentSeries(_GPU + "throttle_reasons"),
        dcgm=(
            DcgmField("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", shipped=False),
            DcgmField("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", rank=1, shipped=False),
        ),
    ),
    Reading(
        "ecc_uncorrected_errors_total",
        "errors",
        Kind.COUNTER,
        (0.0, 1e18),
        Window.EVENTS,
        event="ecc",
        agent=AgentSeries(_GPU + "ecc_errors_total", "type", "uncorrected"),
        dcgm=(DcgmField("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", shipped=False),),
    ),
    Reading(
        "remapped_rows_pending",
        "",
        Kind.FLAG,
        window=Window.ROW,
        agent=AgentSeries(_GPU + "remapped_rows_pending"),
        dcgm=(DcgmField("DCGM_FI_DEV_ROW_REMAP_PENDING", shipped=False),),
    ),
    Reading(
        "remapped_rows_failure",
        "",
        Kind.FLAG,
        window=Window.ROW,
        agent=AgentSeries(_GPU + "remapped_rows_failure"),
        dcgm=(DcgmField("DCGM_FI_DEV_ROW_REMAP_FAILURE"),),
    ),
    # Link-level retries: a GPU whose PCIe or NVLink link retries is a straggler cause worth naming.
    Reading(
        "pcie_replays_total",
        "replays",
        Kind.COUNTER,
        (0.0, 1e18),
        Window.EVENTS,
        event="pcie_replay",
        agent=AgentSeries(_GPU + "pcie_replays_total"),
        dcgm=(DcgmField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER"),),
    ),
    Reading(
        "nvlink_crc_flit_errors_total",
        "errors",
        Kind.COUNTER,
        (0.0, 1e18),
        Window.EVENTS,
        event="nvlink_crc_flit",
        agent=AgentSeries(_GPU + "nvlink_errors_total", "type", "crc_flit"),
        dcgm=(DcgmField("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", shipped=False),),
    ),
    Reading(
        "nvlink_crc_data_errors_total",
        "errors",
        Kind.COUNTER,
        (0.0, 1e18),
        Window.EVENTS,
        event="nvlink_crc_data",
        agent=AgentSeries(_GPU + "nvlink_errors_total", "type", "crc_data"),
        dcgm=(DcgmField("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", shipped=False),),
    ),
    Reading(
        "nvlink_replay_errors_total",
        "errors",
        Kind.COUNTER,
        (0.0, 1e18),
        Window.EVENTS,
        event="nvlink_replay",
        agent=AgentSeries(_GPU + "nvlink_errors_total", "type", "replay"),
        dcgm=(DcgmField("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", shipped=False),),
    ),
    Reading(
        "nvlink_recovery_errors_total",
        "errors",
        Kind.COUNTER,
        (0.0, 1e18),
        Window.EVENTS,
        event="nvlink_recovery",
        agent=AgentSeries(_GPU + "nvlink_errors_total", "type", "recovery"),
        dcgm=(DcgmField("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", shipped=False),),
    ),
    # From the agents' Prometheus series, the sum of the per-code counts (gpufleet_gpu_xid_errors_total
    # by `xid`); from dcgm-exporter's, one per change of the last code.
    Reading("xid_errors_total", "errors", Kind.COUNTER, (0.0, 1e15), Window.EVENTS, event="xid"),
    # The code of the last XID (0: none yet): a new code is seen, the same code again is not.
    Reading("last_xid", "", Kind.LEVEL, (0.0, 1e9), dcgm=(DcgmField("DCGM_FI_DEV_XID_ERRORS"),)),
)


def check(table: tuple[Reading, ...]) -> tuple[Reading, ...]:
    """The table unchanged, or ValueError naming the first row that cannot be derived from."""
    names = [r.name for r in table]
    dcgm = [f.metric for r in table for f in r.dcgm]
    for what, seen in (("reading", names), ("dcgm-exporter metric", dcgm)):
        twice = sorted({n for n in seen if seen.count(n) > 1})
        if twice:
            raise ValueError(f"{what} listed twice: {', '.join(twice)}")
    for r in table:
        if (r.limits is None) != (r.kind is Kind.FLAG):
            raise ValueError(f"{r.name}: a flag has no limits, every other reading has")
        if (r.event is None) == (r.window is Window.EVENTS):
            raise ValueError(f"{r.name}: an event kind goes with Window.EVENTS, and only there")
        if r.window is Window.EVENTS and r.kind is not Kind.COUNTER:
            raise ValueError(f"{r.name}: only a counter's increases are events")
        if r.clamp is not None and (r.limits is None or not r.limits[0] <= r.clamp <= r.limits[1]):
            raise ValueError(f"{r.name}: clamp {r.clamp} outside the limits")
    return table


check(READINGS)
