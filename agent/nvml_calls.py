"""Which NVML call feeds which reading, as data: the single list to check against docs/nvml-calls.md.

Each Call names the GpuSample fields it fills and fetches their raw NVML values in one go (one call can
feed several fields, e.g. utilization rates). Only current, non-deprecated functions appear here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class Call:
    """One NVML call and the readings it fills, in the order fetch() returns their raw values."""

    readings: tuple[str, ...]
    fetch: Callable[[Any, Any], tuple[Any, ...]]


def text(value: Any) -> str:
    """NVML strings arrive as str or bytes depending on the pynvml version; the model wants str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").strip("\x00")
    return str(value)


def _one(fetch: Callable[[Any, Any], Any]) -> Callable[[Any, Any], tuple[Any, ...]]:
    """Wrap a single-value fetch into the tuple form."""
    return lambda nvml, handle: (fetch(nvml, handle),)


def _utilization(nvml: Any, handle: Any) -> tuple[Any, ...]:
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return rates.gpu, rates.memory


def _memory(nvml: Any, handle: Any) -> tuple[Any, ...]:
    info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    return info.used, info.total, info.free


def _remapped_rows(nvml: Any, handle: Any) -> tuple[Any, ...]:
    correctable, uncorrectable, pending, failure = nvml.nvmlDeviceGetRemappedRows(handle)
    return correctable, uncorrectable, pending, failure


def _threshold(name: str) -> Callable[[Any, Any], Any]:
    return lambda nvml, handle: nvml.nvmlDeviceGetTemperatureThreshold(handle, getattr(nvml, name))


def _max_clock(name: str) -> Callable[[Any, Any], Any]:
    return lambda nvml, handle: nvml.nvmlDeviceGetMaxClockInfo(handle, getattr(nvml, name))


def _clock(name: str) -> Callable[[Any, Any], Any]:
    return lambda nvml, handle: nvml.nvmlDeviceGetClockInfo(handle, getattr(nvml, name))


def _ecc(name: str) -> Callable[[Any, Any], Any]:
    return lambda nvml, handle: nvml.nvmlDeviceGetTotalEccErrors(handle, getattr(nvml, name), nvml.NVML_VOLATILE_ECC)


# Strings that identify the GPU; read once at open.
IDENTITY = (
    Call(("uuid",), _one(lambda n, h: text(n.nvmlDeviceGetUUID(h)))),
    Call(("model",), _one(lambda n, h: text(n.nvmlDeviceGetName(h)))),
    Call(("pci_bus_id",), _one(lambda n, h: text(n.nvmlDeviceGetPciInfo_v3(h).busId))),
    Call(("serial",), _one(lambda n, h: text(n.nvmlDeviceGetSerial(h)))),
    Call(("vbios_version",), _one(lambda n, h: text(n.nvmlDeviceGetVbiosVersion(h)))),
)

# Limits that do not change while the driver runs; read once at open.
STATIC = (
    Call(("slowdown_temperature_celsius",), _one(_threshold("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"))),
    Call(("shutdown_temperature_celsius",), _one(_threshold("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"))),
    Call(("max_operating_temperature_celsius",), _one(_threshold("NVML_TEMPERATURE_THRESHOLD_GPU_MAX"))),
    Call(("memory_max_operating_temperature_celsius",), _one(_threshold("NVML_TEMPERATURE_THRESHOLD_MEM_MAX"))),
    Call(("sm_clock_max_hertz",), _one(_max_clock("NVML_CLOCK_SM"))),
    Call(("memory_clock_max_hertz",), _one(_max_clock("NVML_CLOCK_MEM"))),
)

# Read on every poll (besides the field-value batch and GPM).
POLLED = (
    Call(("utilization_ratio", "memory_utilization_ratio"), _utilization),
    Call(("temperature_celsius",), _one(lambda n, h: n.nvmlDeviceGetTemperatureV(h, n.NVML_TEMPERATURE_GPU))),
    Call(("sm_clock_hertz",), _one(_clock("NVML_CLOCK_SM"))),
    Call(("memory_clock_hertz",), _one(_clock("NVML_CLOCK_MEM"))),
    Call(("throttle_reasons",), _one(lambda n, h: n.nvmlDeviceGetCurrentClocksEventReasons(h))),
    Call(("memory_used_bytes", "memory_total_bytes", "memory_free_bytes"), _memory),
    # Operators change power caps at run time, so the limit is polled too.
    Call(("power_limit_watts",), _one(lambda n, h: n.nvmlDeviceGetEnforcedPowerLimit(h))),
    Call(("ecc_corrected_errors_total",), _one(_ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED"))),
    Call(("ecc_uncorrected_errors_total",), _one(_ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"))),
    Call(
        ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure"),
        _remapped_rows,
    ),
)


def cuda_version_text(version: Any) -> str | None:
    """12040 -> '12.4', as nvidia-smi prints the CUDA driver version."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"
