"""A small, programmable fake of the pynvml surface in docs/nvml-calls.md, for the reader's tests.

Unlike the simulator it models no physics: every value is set by the test, and any call can be made
to fail on any GPU. Errors, return structures and constants are nvidia-ml-py's own, so the reader sees
exactly what it would see from pynvml.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpufleet.agent.readings import READINGS, FieldValue


@dataclass
class FakeGpu:
    """One fake GPU; tests mutate these attributes between reads."""

    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:18:00.0"
    serial: str = "1650000000001"
    vbios: str = "96.00.99.00.01"
    thresholds: dict[int, int] = field(
        default_factory=lambda: {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 87,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 92,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 85,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: 95,
        }
    )
    max_clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}
    )
    clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {pynvml.NVML_CLOCK_SM: 1755, pynvml.NVML_CLOCK_MEM: 2619}
    )
    utilization: tuple[int, int] = (98, 41)
    temperature: int = 71
    reasons: int = 0
    memory_used: int = 47_036_445_491
    memory_total: int = 85_520_809_984
    power_limit_mw: int = 700_000
    ecc: dict[int, int] = field(
        default_factory=lambda: {
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: 3,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 0,
        }
    )
    remapped_rows: tuple[int, int, int, int] = (2, 0, 0, 0)
    fan_percent: int | None = 55  # None: no fan NVML can read (an SXM board)
    pstate: int = 0
    encoder_percent: int = 3
    decoder_percent: int = 7
    power_management_limit_mw: int = 650_000
    pcie_replays: int = 4
    # (field id, scope) -> value; int/float. Missing keys answer NOT_SUPPORTED per entry.
    fields: dict[tuple[int, int], int | float] = field(default_factory=dict)
    # (field id, scope) -> per-entry return code overriding success.
    field_codes: dict[tuple[int, int], int] = field(default_factory=dict)
    gpm_supported: bool = True
    # metric id -> percent; metric id -> per-metric return code.
    gpm_values: dict[int, float] = field(
        default_factory=lambda: {pynvml.NVML_GPM_METRIC_SM_UTIL: 81.0, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 40.5}
    )
    gpm_codes: dict[int, int] = field(default_factory=dict)
    xid_supported: bool = True
    pids: tuple[int, ...] = ()
    lost: bool = False


def h100_fields(links: int = 18) -> dict[tuple[int, int], int | float]:
    """A full field-value answer for an H100 with NVLink, in NVML's own units."""
    out: dict[tuple[int, int], int | float] = {
        (pynvml.NVML_FI_DEV_POWER_INSTANT, 0): 655_000,
        (pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0): 2_225_020_545_400,
        (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0): 78,
        (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0): 435_114_117_676,
        (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0): 293_621_035_166,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF): 71_873_845_680,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0xFFFFFFFF): 79_247_496_774,
        (pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP, 0): 1_500_000_000,
        (pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN, 0): 250_000_000,
        (pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, 0): 0,
        (pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN, 0): 7,
        (pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST, 0): 0,
        (pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0): links,
    }
    for link in range(links):
        out[(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link)] = 1000 + link
        out[(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link)] = 2000 + link
    # Every other field of the reading table answers 1, so a reading added there is supported here too.
    for reading in READINGS:
        field_id = getattr(pynvml, getattr(reading.source, "field_id", ""), None)
        if isinstance(reading.source, FieldValue) and isinstance(field_id, int):
            out.setdefault((field_id, reading.source.scope), 1)
    return out


def h100(index: int, links: int = 18) -> FakeGpu:
    """A fully supported H100."""
    return FakeGpu(uuid=f"GPU-{index:08d}-h100", bus_id=f"00000000:{0x18 + index:02X}:00.0", fields=h100_fields(links))


@dataclass
class _Injection:
    code: int
    remaining: int | None  # None: forever


class FakeNvml:
    """A pynvml-compatible object whose GPUs, failures and events are set by the test."""

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        for name, value in vars(pynvml).items():
            if name.startswith(("NVML_", "nvml")) and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, value)
            elif name.startswith("NVMLError") or name.startswith("c_nvml"):
                setattr(self, name, value)
        self.gpus: list[FakeGpu] = gpus if gpus is not None else [h100(0)]
        self.init_failures = 0
        self.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        self.initialized = False
        self.calls: list[tuple[str, int | None]] = []
        self.freed_gpm_samples: list[int] = []
        self.field_requests: list[tuple[int, list[tuple[int, int]]]] = []  # (gpu index, request)
        self._injections: dict[tuple[str, int | None], _Injection] = {}
        self._lock = threading.Lock()
        self._events: deque[Any] = deque()
        self._event_cond = threading.Condition()
        self._wait_calls = 0
        self._last_delivery_call = -1
        self._wait_errors: deque[int] = deque()
        self._gpm_samples: dict[int, int | None] = {}  # sample address -> gpu index it was taken on
        self._next_address = 0x5000

    # -- programming ---------------------------------------------------------------------------

    def inject(self, function: str, code: int, *, index: int | None = None, times: int | None = None) -> None:
        """Make `function` (on GPU `index`, or a library-level call when None) raise NVMLError(code)."""
        self._injections[(function, index)] = _Injection(code, times)

    def clear(self, function: str, *, index: int | None = None) -> None:
        """Stop failing `function`."""
        self._injections.pop((function, index), None)

    def handle(self, index: int) -> Any:
        """The handle nvmlDeviceGetHandleByIndex returns: a real ctypes device pointer, as pynvml's."""
        return ctypes.cast(ctypes.c_void_p(0x1000 + index), pynvml.c_nvmlDevice_t)

    def push_xid(self, index: int | None, code: int, *, address: int | None = None) -> None:
        """Queue one XID event for GPU `index` (or for an unknown device `address`)."""
        data = pynvml.c_nvmlEventData_t()
        target = 0x1000 + index if index is not None else address
        data.device = ctypes.cast(ctypes.c_void_p(target), pynvml.c_nvmlDevice_t)
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = code
        with self._event_cond:
            self._events.append(data)
            self._event_cond.notify_all()

    def push_wait_error(self, code: int) -> None:
        """Make the next event wait fail with NVMLError(code) instead of delivering or timing out."""
        with self._event_cond:
            self._wait_errors.append(code)
            self._event_cond.notify_all()

    def wait_drained(self, timeout: float = 5.0) -> bool:
        """True once every queued event was delivered and the watcher came back for more (so it counted them)."""
        with self._event_cond:
            return self._event_cond.wait_for(
                lambda: not self._events and not self._wait_errors and self._wait_calls > self._last_delivery_call,
                timeout,
            )

    def wait_for_wait_calls(self, count: int, timeout: float = 5.0) -> bool:
        """True once the watcher has entered nvmlEventSetWait_v2 at least `count` times."""
        with self._event_cond:
            return self._event_cond.wait_for(lambda: self._wait_calls >= count, timeout)

    def called(self, function: str, index: int | None = None) -> int:
        """How many times `function` was called (on GPU `index`)."""
        return sum(1 for name, i in list(self.calls) if name == function and (index is None or i == index))

    # -- plumbing ------------------------------------------------------------------------------

    def _index(self, handle: Any) -> int:
        return ctypes.cast(handle, ctypes.c_void_p).value - 0x1000

    def _enter(self, function: str, handle: Any = None) -> FakeGpu | None:
        """Record the call, then raise what the test programmed (GPU lost beats injections)."""
        index = None if handle is None else self._index(handle)
        with self._lock:
            self.calls.append((function, index))
        if function not in ("nvmlInit", "nvmlShutdown") and not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = None if index is None else self.gpus[index]
        if gpu is not None and gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        injection = self._injections.get((function, index))
        if injection is not None:
            if injection.remaining is not None:
                injection.remaining -= 1
                if injection.remaining <= 0:
                    del self._injections[(function, index)]
            raise pynvml.NVMLError(injection.code)
        return gpu

    # -- library -------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_failures > 0:
            self.init_failures -= 1
            raise pynvml.NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return "550.54.15"

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return "12.550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        # Keyed by the index asked for, since there is no handle yet.
        self._enter("nvmlDeviceGetHandleByIndex", self.handle(index))
        return self.handle(index)

    # -- identity and static -------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._enter("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._enter("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        gpu = self._enter("nvmlDeviceGetPciInfo_v3", handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        return info

    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return self._enter("nvmlDeviceGetSerial", handle).serial

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str:
        return self._enter("nvmlDeviceGetVbiosVersion", handle).vbios

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetArchitecture", handle)
        return pynvml.NVML_DEVICE_ARCH_HOPPER

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        return self._enter("nvmlDeviceGetTemperatureThreshold", handle).thresholds[threshold]

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: int) -> int:
        return self._enter("nvmlDeviceGetMaxClockInfo", handle).max_clocks_mhz[clock]

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        gpu = self._enter("nvmlGpmQueryDeviceSupport", handle)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(gpu.gpm_supported)
        return support

    # -- per poll ------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu, rates.memory = gpu.utilization
        return rates

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._enter("nvmlDeviceGetTemperatureV", handle).temperature

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        return self._enter("nvmlDeviceGetClockInfo", handle).clocks_mhz[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle).reasons

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        assert version == pynvml.nvmlMemory_v2
        info = pynvml.c_nvmlMemory_v2_t()
        info.version, info.used, info.total = version, gpu.memory_used, gpu.memory_total
        info.free = max(0, gpu.memory_total - gpu.memory_used)
        return info

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._enter("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        return self._enter("nvmlDeviceGetTotalEccErrors", handle).ecc[error_type]

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._enter("nvmlDeviceGetRemappedRows", handle).remapped_rows

    def nvmlDeviceGetFanSpeed(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetFanSpeed", handle)
        if gpu.fan_percent is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.fan_percent

    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        return self._enter("nvmlDeviceGetPerformanceState", handle).pstate

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        return [self._enter("nvmlDeviceGetEncoderUtilization", handle).encoder_percent, 167_000]

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        return [self._enter("nvmlDeviceGetDecoderUtilization", handle).decoder_percent, 167_000]

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return self._enter("nvmlDeviceGetPowerManagementLimit", handle).power_management_limit_mw

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._enter("nvmlDeviceGetPcieReplayCounter", handle).pcie_replays

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return [pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": 1 << 30}) for pid in gpu.pids]

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[tuple[int, int]]) -> Any:
        gpu = self._enter("nvmlDeviceGetFieldValues", handle)
        self.field_requests.append((self._index(handle), list(field_ids)))
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for slot, (field_id, scope) in zip(values, field_ids):
            slot.fieldId, slot.scopeId, slot.timestamp = field_id, scope, 1_700_000_000_000_000
            _fill(slot, gpu.fields.get((field_id, scope)), gpu.field_codes.get((field_id, scope)))
        return values

    # -- GPM -----------------------------------------------------------------------------------

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        with self._lock:
            self._next_address += 0x10
            address = self._next_address
            self._gpm_samples[address] = None
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._enter("nvmlGpmSampleFree")
        address = ctypes.cast(sample, ctypes.c_void_p).value
        self._gpm_samples.pop(address)
        self.freed_gpm_samples.append(address)

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        self._enter("nvmlGpmSampleGet", handle)
        self._gpm_samples[ctypes.cast(sample, ctypes.c_void_p).value] = self._index(handle)
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self._enter("nvmlGpmMetricsGet")
        first = self._gpm_samples.get(ctypes.cast(request.sample1, ctypes.c_void_p).value)
        second = self._gpm_samples.get(ctypes.cast(request.sample2, ctypes.c_void_p).value)
        if first is None or first != second or request.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[first]
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            metric.nvmlReturn = gpu.gpm_codes.get(metric.metricId, pynvml.NVML_SUCCESS)
            metric.value = gpu.gpm_values.get(metric.metricId, 0.0)
        return request

    # -- events --------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        return pynvml.c_nvmlEventSet_t()

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        gpu = self._enter("nvmlDeviceRegisterEvents", handle)
        if not gpu.xid_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert event_types == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait_v2")
        with self._event_cond:
            self._wait_calls += 1
            self._event_cond.notify_all()
            self._event_cond.wait_for(lambda: self._events or self._wait_errors, timeout_ms / 1000.0)
            if self._wait_errors:
                self._last_delivery_call = self._wait_calls
                raise pynvml.NVMLError(self._wait_errors.popleft())
            if not self._events:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            self._last_delivery_call = self._wait_calls
            return self._events.popleft()

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._enter("nvmlEventSetFree")


def _fill(slot: Any, value: int | float | None, code: int | None) -> None:
    """Write one field entry the way NVML does: its own return code, a typed value on success."""
    if code is not None:
        slot.nvmlReturn = code
        return
    if value is None:
        slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return
    slot.nvmlReturn = pynvml.NVML_SUCCESS
    if isinstance(value, float):
        slot.valueType, slot.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, value
    elif value < 0:
        slot.valueType, slot.value.sllVal = pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, value
    else:
        slot.valueType, slot.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, value
