"""What each NVML call costs on a real GPU, burned as CPU by the simulator so benchmarks pay it too.

The simulator answers a call in microseconds of Python; the real driver spends up to milliseconds of
CPU in some of them (the total energy counter costs about 3 ms a read), so on the free simulator an
agent looks ten times cheaper than on real hardware. `CostedNvml` wraps a
SimNvml and, after each call, spins on the calling thread's CPU clock until the call has cost what the
driver's call costs: CPU is burned, not slept, so process CPU time, thread CPU time and profiles all
see it. The burned share is counted apart, so a benchmark can show the agent, the simulated NVML cost
and the simulator's own bookkeeping separately.

Figures: thread CPU time per call (or per field id, each timed alone in its own
nvmlDeviceGetFieldValues call) on one NVIDIA H100 80GB HBM3, driver 580.159.04, NVML 13.580,
measured by ../shared/hardware/nvmlprof.py and fieldprof.py (files h100-driver-580/nvmlprof.txt and
fieldprof.txt). A field-value batch costs the sum of its fields: the real batch of twelve cost
4.47 ms against 5.06 ms summed, so the model errs on the expensive side.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import defaultdict
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

# NVML function -> thread CPU microseconds per call (nvmlprof.txt, median of 40 cycles).
CALL_COST_US: Mapping[str, float] = MappingProxyType(
    {
        "nvmlDeviceGetTotalEnergyConsumption": 2845.0,
        "nvmlGpmSampleGet": 236.9,
        "nvmlEventSetWait_v2": 164.1,
        "nvmlDeviceGetMemoryInfo": 94.9,
        "nvmlDeviceGetMemoryInfo_v2": 94.9,
        "nvmlDeviceGetRemappedRows": 63.1,
        "nvmlDeviceGetUtilizationRates": 44.8,
        "nvmlDeviceGetComputeRunningProcesses": 40.9,
        "nvmlDeviceGetComputeRunningProcesses_v3": 40.9,
        "nvmlDeviceGetTemperatureV": 28.2,
        "nvmlDeviceGetTotalEccErrors": 12.6,
        "nvmlDeviceGetCurrentClocksEventReasons": 11.7,
        "nvmlDeviceGetClockInfo": 10.5,
        "nvmlDeviceGetEnforcedPowerLimit": 9.1,
        "nvmlDeviceGetPowerUsage": 1.0,
        # One H200, driver 580.159.04 (h200-driver-580/newcalls.txt, newcalls.py): the calls of the
        # readings dcgm-exporter also serves. Fan speed costs as much where unsupported.
        "nvmlDeviceGetPcieReplayCounter": 174.2,
        "nvmlDeviceGetPowerManagementLimit": 164.7,
        "nvmlDeviceGetFanSpeed": 162.0,
        "nvmlDeviceGetPerformanceState": 3.4,
        "nvmlDeviceGetEncoderUtilization": 3.0,
        "nvmlDeviceGetDecoderUtilization": 3.0,
        # MIG, per GPU and per GPU instance: one H200, driver 580, MIG off (MigMode from
        # h200-driver-580/newcalls.txt; the rest tests/fixtures/h200-driver-580/migcalls.txt, where with
        # MIG off the handle lookup answered NotFound and the id and GPM calls InvalidArgument: the cost
        # of those answers stands for the cost of a real one, which no MIG board here has measured).
        "nvmlDeviceGetMigMode": 158.1,
        "nvmlDeviceGetMaxMigDeviceCount": 155.0,
        "nvmlGpmMigSampleGet": 320.0,
        "nvmlDeviceGetMigDeviceHandleByIndex": 13.0,
        "nvmlDeviceGetGpuInstanceId": 3.5,
        "nvmlDeviceGetComputeInstanceId": 3.5,
    }
)
# Field id name -> thread CPU microseconds when asked alone (fieldprof.txt).
FIELD_COST_US: Mapping[str, float] = MappingProxyType(
    {
        "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 3194.0,
        "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 714.0,
        "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 665.0,
        "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 153.0,
        "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 152.0,
        "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 8.0,
        "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 8.0,
        "NVML_FI_DEV_POWER_INSTANT": 3.0,
        "NVML_FI_DEV_MEMORY_TEMP": 3.0,
        "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP": 3.0,
        "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 3.0,
        "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST": 3.0,
        # H200 (newcalls.txt).
        "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 173.8,
        "NVML_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER": 169.1,
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 5.7,
        "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": 5.4,
        "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 5.4,
        "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": 5.5,
        "NVML_FI_DEV_PERF_POLICY_THERMAL": 655.8,
        "NVML_FI_DEV_PERF_POLICY_POWER": 6.3,
    }
)
# nvmlGpmMetricsGet costs its call plus each metric asked (newcalls.txt, each metric alone on an H200:
# 1.2-1.8 us; GRAPHICS_UTIL 1.2-1.5 ms). The call's share is what leaves the H100's two-metric call
# (nvmlprof.txt, 13.4 us) at its measured cost.
GPM_CALL_COST_US = 10.4
GPM_METRIC_COST_US: Mapping[str, float] = MappingProxyType({"NVML_GPM_METRIC_GRAPHICS_UTIL": 1350.0})
DEFAULT_GPM_METRIC_COST_US = 1.5
_GPM_CALL = "nvmlGpmMetricsGet"
# Calls and fields the profile did not time (identity, thresholds, ...): the profile's "everything
# else" ran 3-40 us, so the upper end.
DEFAULT_CALL_COST_US = 40.0
DEFAULT_FIELD_COST_US = 3.0
_FIELD_CALL = "nvmlDeviceGetFieldValues"


# Burned as CRC-32s of zeros: zlib lets go of the GIL for data over 5 KiB, as a real NVML call through
# ctypes does, so the agent's other threads (a scrape) run meanwhile, as on a GPU node. A first small
# block gives the rate; the next is sized to what is left of the cost, so a call lets go of the GIL a
# few times, not thousands. The burn ends a few microseconds late at most, and that overshoot counts as
# the simulator's. The zeros are never written: the kernel maps them to its one zero page, so the 4 MiB
# cost no memory.
_BURN_BLOCK = memoryview(bytes(1 << 22))
_BURN_MIN_BYTES = 8192


def burn(seconds: float) -> None:
    """Spin until this thread has used `seconds` more CPU (a sleep would cost nothing), without the GIL."""
    clock, crc32, block = time.thread_time_ns, zlib.crc32, _BURN_BLOCK
    now = clock()
    end = now + int(seconds * 1e9)
    size = _BURN_MIN_BYTES
    while now < end:
        crc32(block[:size])
        then = clock()
        ns_per_byte = max(then - now, 1) / size
        size = max(_BURN_MIN_BYTES, min(len(block), int(0.95 * (end - then) / ns_per_byte)))
        now = then


class CostedNvml:
    """A pynvml-compatible object (a SimNvml) whose nvml* calls cost real NVML's thread CPU time.

    Everything else (constants, structures, simulator helpers) passes through unchanged. `burned`
    holds the seconds burned per calling thread, so a benchmark can subtract exactly this thread's
    simulated NVML cost.
    """

    def __init__(
        self,
        inner: Any,
        *,
        call_cost_us: Mapping[str, float] = CALL_COST_US,
        field_cost_us: Mapping[str, float] = FIELD_COST_US,
    ) -> None:
        self._inner = inner
        self._call_cost_s = {name: us / 1e6 for name, us in call_cost_us.items()}
        self._field_cost_s = _field_costs(inner, field_cost_us)
        self._gpm_metric_cost_s = _field_costs(inner, GPM_METRIC_COST_US)
        self._lock = threading.Lock()
        self.burned: defaultdict[int, float] = defaultdict(float)
        # Seconds the simulator's own work ran past the real call's cost (all threads): what a benchmark of
        # the whole process subtracts, so a call costs there exactly what the real one does.
        self.excess = 0.0
        self._excess_ns: defaultdict[int, int] = defaultdict(int)  # the same, per thread

    def burned_by_this_thread(self) -> float:
        """Seconds of simulated NVML cost burned on the calling thread so far."""
        return self.burned.get(threading.get_ident(), 0.0)

    def thread_time_ns(self) -> int:
        """The calling thread's CPU clock less the simulator's own work past the real calls' cost: what
        the agent's probes would measure on the GPU, so its tiers fit as they would there."""
        return time.thread_time_ns() - self._excess_ns.get(threading.get_ident(), 0)

    def call_cost(self, name: str, args: Sequence[Any]) -> float:
        """Seconds one call costs on the real driver."""
        if name == _FIELD_CALL and len(args) >= 2:
            fields = self._field_cost_s
            default = DEFAULT_FIELD_COST_US / 1e6
            return sum(fields.get(f if isinstance(f, int) else f[0], default) for f in args[1])
        if name == _GPM_CALL and len(args) >= 1 and name not in self._call_cost_s:
            return self._gpm_cost(args[0])
        return self._call_cost_s.get(name, DEFAULT_CALL_COST_US / 1e6)

    def _gpm_cost(self, request: Any) -> float:
        """Seconds one nvmlGpmMetricsGet costs: the call and each metric it asks for."""
        metrics = self._gpm_metric_cost_s
        default = DEFAULT_GPM_METRIC_COST_US / 1e6
        count = int(getattr(request, "numMetrics", 0))
        asked = (request.metrics[i].metricId for i in range(count))
        return GPM_CALL_COST_US / 1e6 + sum(metrics.get(m, default) for m in asked)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not name.startswith("nvml") or isinstance(value, type) or not callable(value):
            return value
        wrapped = self._costed(name, value)
        setattr(self, name, wrapped)  # later lookups skip __getattr__
        return wrapped

    def _costed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                cost = self.call_cost(name, args)
                # The simulator's own work counts towards the call's cost: burn only what is left.
                remaining = cost - (time.thread_time_ns() - started) / 1e9
                if remaining > 0:
                    burn(remaining)
                    with self._lock:
                        self.burned[threading.get_ident()] += remaining
                over = (time.thread_time_ns() - started) / 1e9 - cost
                if over > 0:
                    with self._lock:
                        self.excess += over
                        self._excess_ns[threading.get_ident()] += int(over * 1e9)

        call.__name__ = name
        return call


def _field_costs(nvml: Any, costs_us: Mapping[str, float]) -> dict[int, float]:
    """Field id -> seconds, for the ids this pynvml defines."""
    out = {}
    for name, us in costs_us.items():
        field_id = getattr(nvml, name, None)
        if isinstance(field_id, int):
            out[field_id] = us / 1e6
    return out
