"""The agent's immutable data model: one GpuSample per GPU, one NodeSnapshot per sampling cycle.

NodeSnapshot.to_dict() is the snapshot contract (schema 1): the agent->server wire format and the
trace format. Every reading a GPU or driver does not support is None here and null on the wire. Each
reading's field carries its row of the agent's reading table (agent.reading_row, gathered by
agent.readings), so a reading is declared once, where its type is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from gpufleet.agent.reading_row import (
    ALL_LINKS,
    CLOCK,
    COUNT,
    COUNTER,
    FLAG,
    KIB_COUNTER,
    MEMORY_CLOCK,
    MIB_RATE,
    POWER,
    RATIO,
    TEMPERATURE,
    Family,
    FieldValue,
    GpmMetric,
    NvmlCall,
    Own,
    PerLinkField,
    Rule,
    reading,
)
from gpufleet.agent.sample_parts import GpuProcess, MigInstance
from gpufleet.reasons import CLOCK_CUT_REASONS, THERMAL_REASONS, ThrottleReason  # noqa: F401 - re-exported

SCHEMA_VERSION = 1

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


# The sources several rows name. Rows naming the same call share one call per read (agent.nvml_calls);
# the thresholds and maximum clocks are limits that do not change while the driver runs, read at open.


def _threshold(name: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetTemperatureThreshold", (name,), at_open=True)


def _ecc(error_type: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetTotalEccErrors", (error_type, "NVML_VOLATILE_ECC"))


def _utilization(part: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetUtilizationRates", part=part)


def _memory(part: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetMemoryInfo", part=part, kwargs=(("version", "nvmlMemory_v2"),))


def _remapped(part: int) -> NvmlCall:
    """One of nvmlDeviceGetRemappedRows' (correctable, uncorrectable, pending, failure)."""
    return NvmlCall("nvmlDeviceGetRemappedRows", part=part)


def _clock(clock: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetClockInfo", (clock,))


def _max_clock(clock: str) -> NvmlCall:
    return NvmlCall("nvmlDeviceGetMaxClockInfo", (clock,), at_open=True)


# The families several of the readings dcgm-exporter also serves share, told apart by a label.
_CODEC = Family("gpufleet_gpu_codec_utilization_ratio", "gauge", "Video encoder or decoder utilization, 0-1.", "codec")
_NVLINK_ERRORS = Family(
    "gpufleet_gpu_nvlink_errors", "counter", "NVLink errors over all links since the driver loaded.", "type"
)
_PIPE = Family("gpufleet_gpu_pipe_active_ratio", "gauge", "GPM: share of time the SMs' pipe was busy, 0-1.", "pipe")
_PCIE_RATE = Family(
    "gpufleet_gpu_pcie_bytes_per_second", "gauge", "GPM: PCIe data rate between two polls.", "direction"
)
_NVLINK_RATE = Family(
    "gpufleet_gpu_nvlink_bytes_per_second",
    "gauge",
    "GPM: NVLink data rate over all links between two polls.",
    "direction",
)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one instant. None means the reading is unsupported (or failed) on this GPU.

    A reading's field carries its row (`reading(source, rule, family, label_value, fast=, nvlink=)`,
    agent.reading_row): how it is read, converted, tiered and exported; agent.readings gathers the rows.
    A field's place here is its place in the snapshot's JSON.
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
    utilization_ratio: float | None = reading(_utilization("gpu"), RATIO, "gpufleet_gpu_utilization_ratio", fast=True)
    memory_utilization_ratio: float | None = reading(
        _utilization("memory"), RATIO, "gpufleet_gpu_memory_utilization_ratio"
    )
    sm_active_ratio: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_SM_UTIL"), RATIO, "gpufleet_gpu_sm_active_ratio", fast=True
    )
    sm_occupancy_ratio: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_SM_OCCUPANCY"), RATIO, "gpufleet_gpu_sm_occupancy_ratio"
    )
    memory_used_bytes: int | None = reading(_memory("used"), COUNT, "gpufleet_gpu_memory_used_bytes")
    memory_total_bytes: int | None = reading(_memory("total"), COUNT, "gpufleet_gpu_memory_total_bytes")
    # Free for allocation: total less used less what the driver reserves (which used leaves out).
    memory_free_bytes: int | None = reading(_memory("free"), COUNT, "gpufleet_gpu_memory_free_bytes")
    memory_reserved_bytes: int | None = reading(
        _memory("reserved"),
        COUNT,
        Family("gpufleet_gpu_memory_reserved_bytes", "gauge", "Device memory the driver reserves (NVML reserved)."),
    )
    temperature_celsius: float | None = reading(
        NvmlCall("nvmlDeviceGetTemperatureV", ("NVML_TEMPERATURE_GPU",)),
        TEMPERATURE,
        "gpufleet_gpu_temperature_celsius",
        fast=True,
    )
    memory_temperature_celsius: float | None = reading(
        FieldValue("NVML_FI_DEV_MEMORY_TEMP"), TEMPERATURE, "gpufleet_gpu_memory_temperature_celsius", fast=True
    )
    slowdown_temperature_celsius: float | None = reading(
        _threshold("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "slowdown",
    )
    shutdown_temperature_celsius: float | None = reading(
        _threshold("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "shutdown",
    )
    max_operating_temperature_celsius: float | None = reading(
        _threshold("NVML_TEMPERATURE_THRESHOLD_GPU_MAX"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "max_operating",
    )
    memory_max_operating_temperature_celsius: float | None = reading(
        _threshold("NVML_TEMPERATURE_THRESHOLD_MEM_MAX"),
        TEMPERATURE,
        "gpufleet_gpu_temperature_limit_celsius",
        "memory_max_operating",
    )
    power_watts: float | None = reading(
        FieldValue("NVML_FI_DEV_POWER_INSTANT"), POWER, "gpufleet_gpu_power_watts", fast=True
    )
    # Operators change power caps at run time, so the limit is polled too.
    power_limit_watts: float | None = reading(
        NvmlCall("nvmlDeviceGetEnforcedPowerLimit"), POWER, "gpufleet_gpu_power_limit_watts"
    )
    energy_joules_total: float | None = reading(
        FieldValue("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
        Rule(div=1000, counter=True),  # mJ -> J
        "gpufleet_gpu_energy_joules",
    )
    sm_clock_hertz: float | None = reading(_clock("NVML_CLOCK_SM"), CLOCK, "gpufleet_gpu_clock_hertz", "sm", fast=True)
    sm_clock_max_hertz: float | None = reading(_max_clock("NVML_CLOCK_SM"), CLOCK, "gpufleet_gpu_clock_max_hertz", "sm")
    memory_clock_hertz: float | None = reading(
        _clock("NVML_CLOCK_MEM"), MEMORY_CLOCK, "gpufleet_gpu_clock_hertz", "memory", fast=True
    )
    memory_clock_max_hertz: float | None = reading(
        _max_clock("NVML_CLOCK_MEM"), MEMORY_CLOCK, "gpufleet_gpu_clock_max_hertz", "memory"
    )
    throttle_reasons: int | None = reading(
        NvmlCall("nvmlDeviceGetCurrentClocksEventReasons"), COUNT, "gpufleet_gpu_throttle_reasons", fast=True
    )
    # Cumulative time spent in each throttle reason, keyed by ThrottleReason.label.
    throttle_seconds_total: Mapping[str, float] = reading(
        Own.THROTTLE_FIELDS,
        Rule(div=1_000_000_000, counter=True),  # ns -> s
        default_factory=lambda: _EMPTY,
    )
    nvlink_tx_bytes_total: int | None = reading(
        FieldValue("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", ALL_LINKS),
        KIB_COUNTER,
        "gpufleet_gpu_nvlink_bytes",
        "tx",
        nvlink=True,
    )
    nvlink_rx_bytes_total: int | None = reading(
        FieldValue("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", ALL_LINKS),
        KIB_COUNTER,
        "gpufleet_gpu_nvlink_bytes",
        "rx",
        nvlink=True,
    )
    # Per-link counters (flag-enabled extra); empty when disabled or unsupported.
    nvlink_link_tx_bytes_total: tuple[int | None, ...] = reading(
        PerLinkField("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"), KIB_COUNTER, default=()
    )
    nvlink_link_rx_bytes_total: tuple[int | None, ...] = reading(
        PerLinkField("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"), KIB_COUNTER, default=()
    )
    pcie_tx_bytes_total: int | None = reading(
        FieldValue("NVML_FI_DEV_PCIE_COUNT_TX_BYTES"), COUNTER, "gpufleet_gpu_pcie_bytes", "tx"
    )
    pcie_rx_bytes_total: int | None = reading(
        FieldValue("NVML_FI_DEV_PCIE_COUNT_RX_BYTES"), COUNTER, "gpufleet_gpu_pcie_bytes", "rx"
    )
    ecc_corrected_errors_total: int | None = reading(
        _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED"), COUNTER, "gpufleet_gpu_ecc_errors", "corrected"
    )
    ecc_uncorrected_errors_total: int | None = reading(
        _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"), COUNTER, "gpufleet_gpu_ecc_errors", "uncorrected"
    )
    remapped_rows_correctable: int | None = reading(_remapped(0), COUNT, "gpufleet_gpu_remapped_rows", "correctable")
    remapped_rows_uncorrectable: int | None = reading(
        _remapped(1), COUNT, "gpufleet_gpu_remapped_rows", "uncorrectable"
    )
    remapped_rows_pending: bool | None = reading(_remapped(2), FLAG, "gpufleet_gpu_remapped_rows_pending")
    remapped_rows_failure: bool | None = reading(_remapped(3), FLAG, "gpufleet_gpu_remapped_rows_failure")
    # The readings dcgm-exporter serves besides these (docs/agent.md, "dcgm-exporter's counters").
    fan_speed_ratio: float | None = reading(
        NvmlCall("nvmlDeviceGetFanSpeed"),
        Rule(div=100, high=2.0),  # NVML allows above 100 %
        Family("gpufleet_gpu_fan_speed_ratio", "gauge", "Fan speed the board drives, share of its maximum."),
    )
    performance_state: int | None = reading(
        NvmlCall("nvmlDeviceGetPerformanceState"),
        Rule(integer=True, high=15),  # NVML_PSTATE_UNKNOWN (32) is no reading
        Family("gpufleet_gpu_performance_state", "gauge", "Performance state (P-state): 0 the highest, 15 the lowest."),
    )
    encoder_utilization_ratio: float | None = reading(
        NvmlCall("nvmlDeviceGetEncoderUtilization", part=0), RATIO, _CODEC, "encoder"
    )
    decoder_utilization_ratio: float | None = reading(
        NvmlCall("nvmlDeviceGetDecoderUtilization", part=0), RATIO, _CODEC, "decoder"
    )
    power_management_limit_watts: float | None = reading(
        NvmlCall("nvmlDeviceGetPowerManagementLimit"),
        POWER,
        Family(
            "gpufleet_gpu_power_management_limit_watts",
            "gauge",
            "Power management limit the operator set; the enforced limit is at most this.",
        ),
    )
    pcie_replays_total: int | None = reading(
        NvmlCall("nvmlDeviceGetPcieReplayCounter"),
        COUNTER,
        Family("gpufleet_gpu_pcie_replays", "counter", "PCIe replays (link-level retries) since the driver loaded."),
    )
    nvlink_crc_flit_errors_total: int | None = reading(
        FieldValue("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"), COUNTER, _NVLINK_ERRORS, "crc_flit", nvlink=True
    )
    nvlink_crc_data_errors_total: int | None = reading(
        FieldValue("NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"), COUNTER, _NVLINK_ERRORS, "crc_data", nvlink=True
    )
    nvlink_replay_errors_total: int | None = reading(
        FieldValue("NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"), COUNTER, _NVLINK_ERRORS, "replay", nvlink=True
    )
    nvlink_recovery_errors_total: int | None = reading(
        FieldValue("NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"), COUNTER, _NVLINK_ERRORS, "recovery", nvlink=True
    )
    # GPM profiling metrics no detector reads, in a second nvmlGpmMetricsGet on the shared call's samples,
    # a read of its own that the tiers slow: GRAPHICS_UTIL costs a thousand times the other metrics (1.2-1.5
    # ms a call on an H200), and each metric converted costs the agent's Python on every read.
    graphics_active_ratio: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_GRAPHICS_UTIL", apart=True),
        RATIO,
        Family(
            "gpufleet_gpu_graphics_active_ratio", "gauge", "GPM: share of time a graphics or compute engine ran, 0-1."
        ),
    )
    tensor_active_ratio: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_ANY_TENSOR_UTIL", apart=True), RATIO, _PIPE, "tensor"
    )
    fp64_active_ratio: float | None = reading(GpmMetric("NVML_GPM_METRIC_FP64_UTIL", apart=True), RATIO, _PIPE, "fp64")
    fp32_active_ratio: float | None = reading(GpmMetric("NVML_GPM_METRIC_FP32_UTIL", apart=True), RATIO, _PIPE, "fp32")
    fp16_active_ratio: float | None = reading(GpmMetric("NVML_GPM_METRIC_FP16_UTIL", apart=True), RATIO, _PIPE, "fp16")
    dram_active_ratio: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_DRAM_BW_UTIL", apart=True),
        RATIO,
        Family("gpufleet_gpu_dram_active_ratio", "gauge", "GPM: DRAM bandwidth used, share of the maximum, 0-1."),
    )
    pcie_tx_bytes_per_second: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_PCIE_TX_PER_SEC", apart=True), MIB_RATE, _PCIE_RATE, "tx"
    )
    pcie_rx_bytes_per_second: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_PCIE_RX_PER_SEC", apart=True), MIB_RATE, _PCIE_RATE, "rx"
    )
    nvlink_tx_bytes_per_second: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", apart=True), MIB_RATE, _NVLINK_RATE, "tx", nvlink=True
    )
    nvlink_rx_bytes_per_second: float | None = reading(
        GpmMetric("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", apart=True), MIB_RATE, _NVLINK_RATE, "rx", nvlink=True
    )
    # Counted from NVML's event set on the XID thread; the count by code and the last code are the XID
    # watcher's own fields.
    xid_errors_total: int | None = reading(Own.XID_EVENTS, COUNTER)
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
    # MIG (agent.mig): True while the GPU is in MIG mode, False where it could be and is not, None where the
    # board or driver has no MIG; then its GPU instances, each with its own memory and GPM activity.
    mig_enabled: bool | None = None
    mig_instances: tuple[MigInstance, ...] = ()
    # Its compute processes with the most memory, bounded per GPU and per node (agent.processes).
    processes: tuple[GpuProcess, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The GPU's object in the snapshot contract."""
        out = {name: getattr(self, name) for name in _FIELDS}
        # Replacing a key's value keeps its place, so the JSON keeps the fields' order.
        for name in _MAPPING_FIELDS:
            value = getattr(self, name)
            out[name] = {str(k): v for k, v in value.items()} if value else {}
        for name in _TUPLE_FIELDS:
            out[name] = list(getattr(self, name))
        for name in _PART_FIELDS:
            out[name] = [part.to_dict() for part in getattr(self, name)]
        return out


# Which GpuSample fields need converting for JSON, decided once from the annotations rather than by an
# isinstance(..., Mapping) per field per sample (an ABC check, once the largest part of to_dict).
_MAPPING_FIELDS = tuple(n for n, t in GpuSample.__annotations__.items() if str(t).startswith("Mapping["))
_TUPLE_FIELDS = tuple(n for n, t in GpuSample.__annotations__.items() if str(t).startswith("tuple["))
_FIELDS = tuple(GpuSample.__annotations__)
_PART_FIELDS = ("mig_instances", "processes")


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
