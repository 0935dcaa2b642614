"""SimNvml: the subset of pynvml that gpufleet's reader calls, answered from the simulated physics.

Signatures, return types (pynvml's own ctypes structures), units and errors (pynvml's own NVMLError
subclasses) match nvidia-ml-py, so the agent runs the same code path on a simulator as on hardware.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pynvml

from gpufleet.agent.sim import physics as ph
from gpufleet.agent.sim.hardware import GpuModel
from gpufleet.agent.sim.mig import MAX_MIG_DEVICES, MIG_CAPABLE, SimInstance, check_layout, instances
from gpufleet.agent.sim.physics import Timeline, build_world, stable_key
from gpufleet.agent.sim.scenario import Incident, JobSpec, Scenario
from gpufleet.agent.sim.tool_calls import ToolCalls

log = logging.getLogger(__name__)

_UINT_MAX = 0xFFFFFFFF
_NOT_AVAILABLE = 0xFFFFFFFF
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_INIT_ERRORS = {
    "driver_not_loaded": pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    "library_not_found": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    "no_permission": pynvml.NVML_ERROR_NO_PERMISSION,
    "unknown": pynvml.NVML_ERROR_UNKNOWN,
}
# Cumulative throttle-time fields -> index of their rate in the physics rate vector.
_THROTTLE_FIELDS = {
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP: ph.NS_SW_POWER_CAP,
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: ph.NS_SW_THERMAL,
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: ph.NS_HW_THERMAL,
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: ph.NS_HW_POWER_BRAKE,
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST: ph.NS_SYNC_BOOST,
}
_PCIE_FIELDS = {
    pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: ph.PCIE_TX_BYTES,
    pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: ph.PCIE_RX_BYTES,
}
_NVLINK_FIELDS = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: ph.NVLINK_TX_KIB,
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: ph.NVLINK_RX_KIB,
}
_COUNTER_FIELDS = {**_THROTTLE_FIELDS, **_PCIE_FIELDS}
_U32 = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
_U64 = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_MIB = 1024 * 1024
# GPM metric -> its value from the mean rates between two samples: percent, or MiB/s for the rates.
# Training runs its math on the tensor cores; the FP32 and FP16 pipes see the elementwise and optimizer
# work beside it, FP64 none.
_GPM_METRICS: dict[int, Callable[[Sequence[float]], float]] = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: lambda r: 100.0 * r[ph.UTIL],
    pynvml.NVML_GPM_METRIC_SM_UTIL: lambda r: 100.0 * r[ph.SM],
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: lambda r: 100.0 * r[ph.OCC],
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: lambda r: 100.0 * r[ph.TENSOR],
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: lambda r: 100.0 * r[ph.MEM_UTIL],
    pynvml.NVML_GPM_METRIC_FP64_UTIL: lambda r: 0.0,
    pynvml.NVML_GPM_METRIC_FP32_UTIL: lambda r: 17.0 * r[ph.TENSOR],
    pynvml.NVML_GPM_METRIC_FP16_UTIL: lambda r: 6.0 * r[ph.TENSOR],
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: lambda r: r[ph.PCIE_TX_BYTES] / _MIB,
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: lambda r: r[ph.PCIE_RX_BYTES] / _MIB,
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: lambda r: r[ph.NVLINK_TX_KIB] / 1024,
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: lambda r: r[ph.NVLINK_RX_KIB] / 1024,
}
_PERCENT_METRICS = frozenset(_GPM_METRICS) - {
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
}
# NVLink error fields -> the share of a link_errors incident's replays each counts: a replay follows a
# flit CRC error; data CRC errors and recoveries stay at 0.
_NVLINK_ERROR_FIELDS = {
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: 1,
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: 1,
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: 0,
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: 0,
}


_FV = pynvml.c_nvmlFieldValue_t
_SET_FIELD_ID = _FV.fieldId.__set__
_SET_SCOPE_ID = _FV.scopeId.__set__
_SET_TIMESTAMP = _FV.timestamp.__set__
_SET_RETURN = _FV.nvmlReturn.__set__
_SET_VALUE_TYPE = _FV.valueType.__set__
_GET_VALUE = _FV.value.__get__
_SET_UI = pynvml.c_nvmlValue_t.uiVal.__set__
_SET_ULL = pynvml.c_nvmlValue_t.ullVal.__set__


def _error(code: int) -> pynvml.NVMLError:
    """pynvml's own exception subclass for an NVML return code."""
    return pynvml.NVMLError(code)


def _address(obj: Any) -> int | None:
    """The pointer value of a ctypes handle, or None for anything that is not one."""
    try:
        return ctypes.cast(obj, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One XID event due on one of this node's GPUs."""

    time_s: float
    gpu: int
    code: int


class _EventSet:
    """Registrations and delivery cursor of one nvmlEventSet."""

    def __init__(self) -> None:
        self.registered: dict[int, float] = {}
        self.cursor = 0
        self.freed = False


class _GpmSample:
    """What nvmlGpmSampleGet recorded into one sample buffer."""

    __slots__ = ("gpu", "t", "instance")

    def __init__(self) -> None:
        self.gpu: int | None = None
        self.t = 0.0
        self.instance: SimInstance | None = None  # nvmlGpmMigSampleGet's GPU instance


class SimNvml(ToolCalls):
    """A pynvml-compatible NVML for one node of a scenario; every NVML_*/nvml* constant is an attribute."""

    def __init__(
        self,
        scenario: Scenario,
        node: str,
        clock: Callable[[], float] = time.time,
        epoch: float | None = None,
        seed: int = 0,
        *,
        block_on_events: bool | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.scenario = scenario
        self.node = node
        self.seed = seed
        self._spec = scenario.node(node)
        self._model: GpuModel = self._spec.model
        self._clock = clock
        self.epoch = clock() if epoch is None else float(epoch)
        # A real clock makes nvmlEventSetWait_v2 wait like the driver does; a fake one never blocks.
        self._block = (clock is time.time) if block_on_events is None else block_on_events
        self._monotonic = monotonic  # what nvmlEventSetWait_v2's timeout is measured on, as the driver's
        self._lock = threading.RLock()
        # Event waiters sleep on this until an event is due, their set is freed or NVML shut down; never in
        # slices, which would take the GIL from a thread answering a scrape every few milliseconds.
        self._events_changed = threading.Condition(self._lock)
        # The scenario time at which a waiter wants waking (an event of its set falls due); an injected
        # clock tells no one when it moves, so the calls that read it look (math.inf: no one waits).
        self._wake_at_s = math.inf
        self._timeline = Timeline(build_world(scenario, node, seed))
        self._init_count = 0
        count = self._spec.gpu_count
        base = 0x7F0000000000 + ((stable_key("handles", node) & 0xFFFF) << 20)
        self._handle_addr = tuple(base + 0x1000 * (i + 1) for i in range(count))
        self._handle_index = {a: i for i, a in enumerate(self._handle_addr)}
        self._next_alloc = base + 0x80000
        self._gpm: dict[int, _GpmSample] = {}
        self._event_sets: dict[int, _EventSet] = {}
        self._incidents = self._own_incidents(scenario, node)
        self._xids = self._xid_schedule()
        self._pids = self._assign_pids()
        self._uuids = tuple(self._uuid(i) for i in range(count))
        self._mig = {
            gpu: instances(node, self._model, gpu, check_layout(self._model, names)) for gpu, names in self._spec.mig
        }
        self._mig_handles = {
            base + 0x1000 * (i.gpu + 1) + 0x10 * (i.position + 1): i for g in self._mig.values() for i in g
        }
        log.debug(
            "simulated NVML ready",
            extra={"scenario": scenario.name, "node": node, "gpus": count, "epoch": self.epoch, "seed": seed},
        )

    # --- set-up --------------------------------------------------------------------------------------

    @staticmethod
    def _own_incidents(scenario: Scenario, node: str) -> dict[str, tuple[Incident, ...]]:
        out: dict[str, list[Incident]] = {}
        for inc in scenario.incidents:
            if node in inc.nodes or any(ref_node == node for ref_node, _ in inc.gpus):
                out.setdefault(inc.kind, []).append(inc)
        return {k: tuple(v) for k, v in out.items()}

    def _xid_schedule(self) -> tuple[XidEvent, ...]:
        events = []
        for inc in self._incidents.get("xid", ()):
            span = (inc.end_s - inc.start_s) if inc.end_s is not None else float(inc.count)
            for node, gpu in inc.gpus:
                if node != self.node:
                    continue
                for n in range(inc.count):
                    events.append(XidEvent(inc.start_s + span * n / inc.count, gpu, inc.code))
        events.sort(key=lambda e: (e.time_s, e.gpu))
        return tuple(events)

    def _assign_pids(self) -> dict[tuple[str, int], int]:
        taken: set[int] = set()
        out: dict[tuple[str, int], int] = {}
        for job in self.scenario.jobs:
            for node, gpu in job.gpus:
                if node != self.node:
                    continue
                pid = 2000 + stable_key("pid", job.id, node, gpu) % 4_000_000
                while pid in taken:
                    pid += 1
                taken.add(pid)
                out[(job.id, gpu)] = pid
        return out

    def _uuid(self, index: int) -> str:
        h = hashlib.blake2b(f"{self.node}/{index}".encode(), digest_size=16).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def materialize_procfs(self, root: Path) -> tuple[int, ...]:
        """Write <root>/<pid>/environ, cgroup and comm (and a pod's resolv.conf and service account namespace
        under root/) for every compute process this node's GPUs can report."""
        root = Path(root)
        written = []
        for job in self.scenario.jobs:
            for rank, (node, gpu) in enumerate(job.gpus):
                if node != self.node:
                    continue
                pid = self._pids[(job.id, gpu)]
                proc = root / str(pid)
                proc.mkdir(parents=True, exist_ok=True)
                process = _pod_process if job.scheduler == "kubernetes" else _slurm_process
                env, cgroup, resolv = process(job, node, gpu, rank)
                (proc / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
                (proc / "cgroup").write_text(cgroup)
                (proc / "comm").write_text("python3\n")  # what the kernel shows of a training script
                if resolv is not None:
                    (proc / "root" / "etc").mkdir(parents=True, exist_ok=True)
                    (proc / "root" / "etc" / "resolv.conf").write_text(resolv)
                    account = proc / "root" / "var" / "run" / "secrets" / "kubernetes.io" / "serviceaccount"
                    account.mkdir(parents=True, exist_ok=True)
                    (account / "namespace").write_text(job.id.rpartition("/")[0] or "default")
                written.append(pid)
        log.debug("materialized simulated procfs", extra={"root": str(root), "pids": len(written)})
        return tuple(written)

    # --- helpers -------------------------------------------------------------------------------------

    def scenario_time(self) -> float:
        """Seconds since the scenario epoch by the injected clock; wakes an event waiter whose event is due."""
        t = self._clock() - self.epoch
        if t >= self._wake_at_s:
            self._wake_waiters()
        return t

    def _wake_waiters(self) -> None:
        with self._events_changed:
            self._wake_at_s = math.inf  # each waiter woken says again when it next wants waking
            self._events_changed.notify_all()

    def _require_init(self) -> None:
        if self._init_count <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: Any) -> tuple[int, float]:
        """Index and scenario time for a device call; raises what NVML would for this handle now."""
        self._require_init()
        index = self._handle_index.get(_address(handle) or -1)
        if index is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        t = self.scenario_time()
        self._check_lost(index, t)
        return index, t

    def _check_lost(self, index: int, t: float) -> None:
        for inc in self._incidents.get("gpu_lost", ()):
            if (self.node, index) in inc.gpus and inc.active(t):
                raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(self._handle_addr[index]), pynvml.c_nvmlDevice_t)

    def _alloc_address(self) -> int:
        self._next_alloc += 0x100
        return self._next_alloc

    def _power_cap_w(self, index: int, t: float) -> float | None:
        cap = None
        for inc in self._incidents.get("power_cap", ()):
            if (self.node, index) in inc.gpus and inc.active(t):
                cap = inc.watts if cap is None else min(cap, inc.watts)
        return cap

    # --- library -------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """Initialise; fails with the scenario's error inside an nvml_init_failure window."""
        t = self.scenario_time()
        for inc in self._incidents.get("nvml_init_failure", ()):
            if inc.active(t):
                raise _error(_INIT_ERRORS[inc.error])
        with self._lock:
            self._init_count += 1
        return None

    def nvmlShutdown(self) -> None:
        """Drop one reference; at zero, wake any waiting event thread."""
        with self._lock:
            self._require_init()
            self._init_count -= 1
            if self._init_count == 0:
                self._events_changed.notify_all()
        return None

    def nvmlSystemGetDriverVersion(self) -> str:
        self._require_init()
        return self.scenario.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._require_init()
        return f"12.{self.scenario.driver_version}"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._require_init()
        return self.scenario.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        return self._spec.gpu_count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._require_init()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._spec.gpu_count:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._check_lost(index, self.scenario_time())
        return self._handle(index)

    # --- identity ------------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        instance = self._mig_device(handle)
        if instance is not None:
            return instance.uuid
        index, _ = self._device(handle)
        return self._uuids[index]

    def nvmlDeviceGetName(self, handle: Any) -> str:
        instance = self._mig_device(handle)
        if instance is not None:
            return f"{self._model.name} MIG {instance.profile.name}"
        self._device(handle)
        return self._model.name

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        index, _ = self._device(handle)
        bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else (0x10 + 0x10 * index) & 0xFF
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = f"0000:{bus:02X}:00.0".encode()
        info.domain, info.bus, info.device = 0, bus, 0
        info.pciDeviceId = self._model.pci_device_id
        info.pciSubSystemId = self._model.pci_subsystem_id
        info.busId = f"00000000:{bus:02X}:00.0".encode()
        return info

    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        index, _ = self._device(handle)
        return str(1650000000000 + stable_key("serial", self.node, index) % 10_000_000_000)

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str:
        self._device(handle)
        return self._model.vbios_version

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        self._device(handle)
        return self._model.architecture

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        self._device(handle)
        model = self._model
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: model.shutdown_celsius,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: model.slowdown_celsius,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: model.gpu_max_celsius,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: model.mem_max_celsius,
        }
        if not 0 <= threshold < pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        value = values.get(threshold)
        if value is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002 - pynvml's name
        self._device(handle)
        return self._clock_mhz(type, self._model.sm_clock_max_mhz, self._model.mem_clock_max_mhz)

    def _clock_mhz(self, clock_type: int, sm: float, mem: float) -> int:
        if clock_type in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return int(round(sm))
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return int(round(mem))
        if clock_type == pynvml.NVML_CLOCK_VIDEO:
            return int(round(sm * 0.89))
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        instance = self._mig_device(handle)
        if instance is not None:
            return self._mig_memory(instance, version)
        index, t = self._device(handle)
        model = self._model
        with self._lock:
            used = self._timeline.state(index, t).memory_used_bytes
        if not version:
            info = pynvml.c_nvmlMemory_t()
            info.total = model.memory_total_bytes
            info.used = used + model.memory_reserved_bytes
            info.free = info.total - info.used
            return info
        if version != pynvml.nvmlMemory_v2:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info = pynvml.c_nvmlMemory_v2_t()
        info.version = version
        info.total = model.memory_total_bytes
        info.reserved = model.memory_reserved_bytes
        info.used = used
        info.free = model.memory_total_bytes - model.memory_reserved_bytes - used
        return info

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        index, t = self._device(handle)
        cap = self._power_cap_w(index, t)
        # The limit the physics' power governor holds: an operator cannot raise it above the board's.
        return int(round(1000 * (self._model.tdp_watts if cap is None else min(cap, self._model.tdp_watts))))

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> pynvml.c_nvmlGpmSupport_t:
        self._device(handle)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1 if self._model.gpm_supported else 0
        return support

    # --- per poll ------------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> pynvml.c_nvmlUtilization_t:
        index, t = self._device(handle)
        with self._lock:
            rates = self._timeline.mean(index, t - 1.0, t)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = int(round(100 * rates[ph.UTIL]))
        util.memory = int(round(100 * rates[ph.MEM_UTIL]))
        return util

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: int = pynvml.nvmlTemperature_v1) -> int:
        index, t = self._device(handle)
        if version != pynvml.nvmlTemperature_v1:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            return int(round(self._timeline.temperature(index, t)))

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002 - pynvml's name
        index, t = self._device(handle)
        with self._lock:
            rates = self._timeline.mean(index, t - 1.0, t)
        return self._clock_mhz(type, rates[ph.SM_CLOCK_MHZ], rates[ph.MEM_CLOCK_MHZ])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        index, t = self._device(handle)
        with self._lock:
            return self._timeline.state(index, t).reasons

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
        index, t = self._device(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        with self._lock:
            tl = self._timeline
            reading = _FieldReading(
                self._model,
                tl.state(index, t),
                tl.integral(index, t),
                tl.counter_base(index, t),
                tl.temperature(index, t),
                tl.world.gpus[tl.world.own[index]].link_weights,
                self._link_errors(index, t, "nvlink_replays"),
            )
        stamp = int(self._clock() * 1e6)
        for i, field in enumerate(fieldIds):
            if isinstance(field, int):
                fid, scope = field, 0
            else:
                fid, scope = field
            reading.fill(values[i], fid, scope, stamp)
        return values

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        index, t = self._device(handle)
        if errorType not in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if counterType not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        uncorrected = errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        total = self._ecc_count(index, t, uncorrected)
        if counterType == pynvml.NVML_VOLATILE_ECC:
            total -= self._ecc_count(index, self._last_reset(index, t), uncorrected)
        return total

    def _ecc_count(self, index: int, t: float, uncorrected: bool) -> int:
        total = 0
        for inc in self._incidents.get("ecc_errors", ()):
            if (self.node, index) not in inc.gpus or t < inc.start_s:
                continue
            count = inc.uncorrected if uncorrected else inc.corrected
            end = inc.end_s if inc.end_s is not None else inc.start_s + 1.0
            share = min(1.0, (t - inc.start_s) / (end - inc.start_s))
            total += int(math.floor(count * share + 1e-9)) if share < 1.0 else count
        return total

    def _link_errors(self, index: int, t: float, attr: str) -> int:
        """A link_errors counter (nvlink_replays, pcie_replays) at t, counted since the last counter reset."""
        incidents = self._incidents.get("link_errors", ())
        if not incidents:
            return 0
        reset = self._last_reset(index, t)
        total = 0
        for inc in incidents:
            if (self.node, index) in inc.gpus:
                total += _ramp(getattr(inc, attr), inc, t) - _ramp(getattr(inc, attr), inc, reset)
        return total

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        index, t = self._device(handle)
        return self._link_errors(index, t, "pcie_replays")

    def nvmlDeviceGetFanSpeed(self, handle: Any) -> int:
        index, t = self._device(handle)
        if not self._model.has_fan:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        # The board's fan curve: 30 % cool, full at the slowdown temperature.
        with self._lock:
            temp = self._timeline.temperature(index, t)
        share = (temp - 40.0) / max(1.0, self._model.slowdown_celsius - 40.0)
        return int(round(100 * min(1.0, max(0.3, share))))

    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        self._device(handle)
        # Data-center boards stay in P0 while the driver is persistent, idle or busy (an H100 reads P0 idle).
        return pynvml.NVML_PSTATE_0

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        self._device(handle)
        return [0, 100000]  # (percent, sampling period in us): training runs no video

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        self._device(handle)
        return [0, 100000]

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        index, t = self._device(handle)
        cap = self._power_cap_w(index, t)
        return int(round(1000 * (self._model.tdp_watts if cap is None else min(cap, self._model.tdp_watts))))

    def _last_reset(self, index: int, t: float) -> float:
        last = -1.0
        for inc in self._incidents.get("counter_reset", ()):
            if (self.node, index) in inc.gpus and inc.start_s <= t:
                last = max(last, inc.start_s)
        return last

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        index, t = self._device(handle)
        if not self._model.remapped_rows_supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rows = self._ecc_count(index, t, True)
        pending = rows - self._ecc_count(index, self._last_reset(index, t), True)
        return (0, rows, 1 if pending > 0 else 0, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        index, t = self._device(handle)
        with self._lock:
            state = self._timeline.state(index, t)
        if state.job is None:
            return []
        info = pynvml.c_nvmlProcessInfo_v3_t()
        info.pid = self._pids[(state.job, index)]
        info.usedGpuMemory = state.memory_used_bytes
        info.gpuInstanceId = _NOT_AVAILABLE
        info.computeInstanceId = _NOT_AVAILABLE
        if self._mig.get(index):  # in MIG mode a process runs in one instance: the job's in the first
            first = self._mig[index][0]
            info.gpuInstanceId, info.computeInstanceId = first.gpu_instance_id, first.compute_instance_id
            slices = sum(i.profile.memory_slices for i in self._mig[index])
            info.usedGpuMemory = first.memory_used_bytes(state.memory_used_bytes, slices)
        return [pynvml.nvmlStructToFriendlyObject(info)]

    # --- GPM -----------------------------------------------------------------------------------------

    def nvmlGpmSampleAlloc(self) -> Any:
        self._require_init()
        with self._lock:
            address = self._alloc_address()
            self._gpm[address] = _GpmSample()
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._require_init()
        with self._lock:
            if self._gpm.pop(_address(gpmSample) or -1, None) is None:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return None

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        index, t = self._device(device)
        if not self._model.gpm_supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sample = self._gpm.get(_address(gpmSample) or -1)
        if sample is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        sample.gpu, sample.t, sample.instance = index, t, None
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._require_init()
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm.get(_address(metricsGet.sample1) or -1)
        second = self._gpm.get(_address(metricsGet.sample2) or -1)
        if first is None or second is None or first.gpu is None or first.gpu != second.gpu:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if first.instance is not second.instance:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        share = 1.0 if first.instance is None else first.instance.activity_share
        if not self._model.gpm_supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            rates = self._timeline.mean(first.gpu, min(first.t, second.t), max(first.t, second.t))
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            value_of = _GPM_METRICS.get(metric.metricId)
            if value_of is None:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                metric.value = 0.0
                continue
            value = max(0.0, share * value_of(rates))
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = min(100.0, value) if metric.metricId in _PERCENT_METRICS else value
        return metricsGet

    # --- MIG ------------------------------------------------------------------------------------------
    # As NVML answers (an H200 on driver 580 with MIG off: tests/fixtures/h200-driver-580/migcalls.txt):
    # NotSupported on a board without MIG, a max count of 0 while MIG is off, NotFound for an index with no
    # instance (every index while MIG is off), InvalidArgument beyond the max; instance ids asked of a
    # whole GPU's handle and an instance GPM sample of a GPU not in MIG mode are InvalidArgument.

    def _mig_device(self, handle: Any) -> SimInstance | None:
        """The GPU instance a MIG device handle stands for (its parent checked as any device); else None."""
        instance = self._mig_handles.get(_address(handle) or -1)
        if instance is not None:
            self._require_init()
            self._check_lost(instance.gpu, self.scenario_time())
        return instance

    def _mig_capable(self, handle: Any) -> int:
        index, _ = self._device(handle)
        if self._model.key not in MIG_CAPABLE:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return index

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if self._mig_capable(device) in self._mig else 0
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        index, _ = self._device(device)
        return MAX_MIG_DEVICES if self._model.key in MIG_CAPABLE and index in self._mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._mig_capable(device)
        if not isinstance(index, int) or not 0 <= index < MAX_MIG_DEVICES:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(self._mig.get(gpu, ())):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        address = next(a for a, i in self._mig_handles.items() if i is self._mig[gpu][index])
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> int:
        if self._mig_device(device) is not None:
            return 1
        self._device(device)
        return 0

    def _mig_only(self, device: Any) -> SimInstance:
        instance = self._mig_device(device)
        if instance is None:
            self._device(device)
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return instance

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig_only(device).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig_only(device).compute_instance_id

    def _mig_memory(self, instance: SimInstance, version: int | None) -> Any:
        """A GPU instance's memory: its slices' share of the parent's job memory (the parent's job spans them)."""
        with self._lock:
            parent_used = self._timeline.state(instance.gpu, self.scenario_time()).memory_used_bytes
        slices = sum(i.profile.memory_slices for i in self._mig[instance.gpu])
        used = instance.memory_used_bytes(parent_used, slices)
        if version and version != pynvml.nvmlMemory_v2:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info = pynvml.c_nvmlMemory_v2_t() if version else pynvml.c_nvmlMemory_t()
        if version:
            info.version = version
        info.total, info.used, info.free = instance.memory_total_bytes, used, instance.memory_total_bytes - used
        return info

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        index, t = self._device(device)
        if not self._model.gpm_supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        instance = next((i for i in self._mig.get(index, ()) if i.gpu_instance_id == gpuInstanceId), None)
        sample = self._gpm.get(_address(gpmSample) or -1)
        if instance is None or sample is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        sample.gpu, sample.t, sample.instance = index, t, instance
        return gpmSample

    # --- XID events ----------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self._require_init()
        with self._lock:
            address = self._alloc_address()
            self._event_sets[address] = _EventSet()
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlEventSet_t)

    def _event_set(self, eventSet: Any) -> _EventSet:
        es = self._event_sets.get(_address(eventSet) or -1)
        if es is None or es.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return es

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        index, t = self._device(handle)
        es = self._event_set(eventSet)
        if not eventTypes & pynvml.nvmlEventTypeXidCriticalError:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            es.registered.setdefault(index, t)
        return None

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> pynvml.c_nvmlEventData_t:
        """Return the next due XID event, each exactly once; NVMLError_Timeout when none is due. Blocking, it
        waits up to timeoutms (real time, as the driver does) for one to fall due."""
        self._require_init()
        event = self._next_event(self._event_set(eventSet))
        if event is None and self._block and timeoutms > 0:
            event = self._wait_event(eventSet, timeoutms / 1000.0)
        if event is None:
            raise _error(pynvml.NVML_ERROR_TIMEOUT)
        data = pynvml.c_nvmlEventData_t()
        data.device = self._handle(event.gpu)
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = event.code
        data.gpuInstanceId = _NOT_AVAILABLE
        data.computeInstanceId = _NOT_AVAILABLE
        return data

    def _wait_event(self, eventSet: Any, timeout_s: float) -> XidEvent | None:
        """The next event to fall due within timeout_s, waking only when one does (or the set is freed, or NVML
        shut down). The wall clock is waited on until the event's time; an injected clock moves unseen, so the
        waiter is woken by the first call that reads it past the event's time (the sampler's, every cycle)."""
        deadline = self._monotonic() + timeout_s
        with self._events_changed:
            while True:
                self._require_init()
                es = self._event_set(eventSet)
                event = self._next_event(es)
                left = deadline - self._monotonic()
                if event is not None or left <= 0:
                    return event
                upcoming = self._upcoming_time(es)
                if upcoming is not None:
                    self._wake_at_s = min(self._wake_at_s, upcoming)
                    # Read again after saying when: a clock moved past it in between is seen here, not missed.
                    due_in_s = upcoming - self.scenario_time()
                    if due_in_s <= 0:
                        continue
                    if self._clock is time.time:
                        left = min(left, due_in_s)
                self._events_changed.wait(left)

    def _next_event(self, es: _EventSet) -> XidEvent | None:
        now = self.scenario_time()
        with self._lock:
            while es.cursor < len(self._xids):
                event = self._xids[es.cursor]
                if event.time_s > now:
                    return None
                es.cursor += 1
                since = es.registered.get(event.gpu)
                if since is not None and event.time_s >= since:
                    return event
        return None

    def _upcoming_time(self, es: _EventSet) -> float | None:
        with self._lock:
            for event in self._xids[es.cursor :]:
                if event.gpu in es.registered:
                    return event.time_s
        return None

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._require_init()
        with self._lock:
            es = self._event_set(eventSet)
            es.freed = True
            self._events_changed.notify_all()
            del self._event_sets[_address(eventSet) or -1]
        return None


class _FieldReading:
    """The values one nvmlDeviceGetFieldValues call reports, computed once per call."""

    __slots__ = ("model", "state", "counters", "temp_c", "weights", "nvlink_replays")

    def __init__(
        self,
        model: GpuModel,
        state: ph.BucketState,
        integral: tuple[float, ...],
        base: tuple[float, ...],
        temp_c: float,
        weights: tuple[float, ...],
        nvlink_replays: int = 0,
    ):
        self.model = model
        self.state = state
        self.counters = [max(0.0, a - b) for a, b in zip(integral, base)]
        self.temp_c = temp_c
        self.weights = weights
        self.nvlink_replays = nvlink_replays

    def fill(self, out: Any, fid: int, scope: int, stamp: int) -> None:
        """Set ids, timestamp, value, valueType and nvmlReturn of one field entry."""
        # Straight to the ctypes descriptors: pynvml's printable-structure hooks cost more than the physics.
        _SET_FIELD_ID(out, fid)
        _SET_SCOPE_ID(out, scope)
        _SET_TIMESTAMP(out, stamp)
        result = self._value(fid, scope)
        if isinstance(result, int):
            _SET_RETURN(out, -result)
            return
        value_type, value = result
        _SET_VALUE_TYPE(out, value_type)
        if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
            _SET_UI(_GET_VALUE(out), value)
        else:
            _SET_ULL(_GET_VALUE(out), value)

    def _value(self, fid: int, scope: int) -> Any:
        """(valueType, value), or a negated NVML error code for this entry."""
        model = self.model
        slot = _NVLINK_FIELDS.get(fid)
        if slot is not None:  # checked first: per-link queries are most of a batch
            if not model.has_nvlink:
                return -pynvml.NVML_ERROR_NOT_SUPPORTED
            if scope == _UINT_MAX:
                return _U64, int(self.counters[slot])
            if scope < model.nvlink_links:
                return _U64, int(self.counters[slot] * self.weights[scope])
            return -pynvml.NVML_ERROR_INVALID_ARGUMENT
        slot = _COUNTER_FIELDS.get(fid)
        if slot is not None:
            return _U64, int(self.counters[slot])
        if fid == pynvml.NVML_FI_DEV_POWER_INSTANT:
            return _U32, int(round(1000 * self.state.rates[ph.POWER_W]))
        if fid == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return _U64, int(1000 * self.counters[ph.POWER_W])
        if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            if not model.has_memory_temperature:
                return -pynvml.NVML_ERROR_NOT_SUPPORTED
            return _U32, int(round(self.temp_c + self.state.rates[ph.MEM_TEMP_EXCESS]))
        if fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
            if not model.has_nvlink:
                return -pynvml.NVML_ERROR_NOT_SUPPORTED
            return _U32, model.nvlink_links
        share = _NVLINK_ERROR_FIELDS.get(fid)
        if share is not None:
            if not model.has_nvlink:
                return -pynvml.NVML_ERROR_NOT_SUPPORTED
            return _U64, share * self.nvlink_replays
        return -pynvml.NVML_ERROR_NOT_SUPPORTED


def _ramp(count: int, inc: Incident, t: float) -> int:
    """How many of an incident's `count` events happened by t, spread evenly from its start to its end."""
    if t < inc.start_s or count <= 0:
        return 0
    end = inc.end_s if inc.end_s is not None else inc.start_s + 1.0
    share = min(1.0, (t - inc.start_s) / (end - inc.start_s))
    return count if share >= 1.0 else int(math.floor(count * share + 1e-9))


def _copy_pynvml_names() -> None:
    """Expose pynvml's NVML_*/nvml* int constants, its structures and its error classes on SimNvml."""
    for name, value in vars(pynvml).items():
        if hasattr(SimNvml, name):
            continue
        is_constant = name.startswith(("NVML_", "nvml")) and isinstance(value, int) and not isinstance(value, bool)
        is_type = isinstance(value, type) and name.startswith(("NVMLError", "c_nvml", "nvml", "struct_c_nvml"))
        if is_constant or is_type:
            setattr(SimNvml, name, value)


_copy_pynvml_names()


def _slurm_process(job: JobSpec, node: str, gpu: int, rank: int) -> tuple[dict[str, str], str, None]:
    """A job step's task as slurmstepd starts it (cgroup v2)."""
    env = {
        "SLURM_JOB_ID": job.id,
        "SLURM_JOB_USER": job.user,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(gpu),
        "SLURM_NODEID": str(job.nodes.index(node)),
        "CUDA_VISIBLE_DEVICES": str(gpu),
        "HOME": f"/home/{job.user}",
        "PATH": "/usr/bin:/bin",
    }
    return env, f"0::/system.slice/slurmstepd.scope/job_{job.id}/step_0/user/task_0\n", None


def _pod_process(job: JobSpec, node: str, gpu: int, rank: int) -> tuple[dict[str, str], str, str]:
    """A training pod's process as a Kubernetes operator starts it, with the GPUFLEET_JOB variable that
    docs/agent.md asks the pod template to set from the job's label, and the resolv.conf the kubelet
    writes into the pod (a job id NAMESPACE/NAME runs in NAMESPACE); one pod per node of the job."""
    namespace, _, name = job.id.rpartition("/")
    node_rank = job.nodes.index(node)
    pod = f"{name}-worker-{node_rank}"
    uid = hashlib.blake2b(f"{job.id}/{node}".encode(), digest_size=16).hexdigest()
    pod_uid = f"{uid[:8]}_{uid[8:12]}_{uid[12:16]}_{uid[16:20]}_{uid[20:]}"
    container = hashlib.blake2b(f"{job.id}/{node}/trainer".encode(), digest_size=32).hexdigest()
    gpus_here = sum(1 for n, _ in job.gpus if n == node)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOSTNAME": pod,
        "HOME": "/root",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "MASTER_ADDR": f"{name}-worker-0",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": str(len(job.gpus)),
        "RANK": str(rank),
        "LOCAL_RANK": str(gpu),
        "LOCAL_WORLD_SIZE": str(gpus_here),
        "GPUFLEET_JOB": job.id,
    }
    cgroup = f"0::/kubepods.slice/kubepods-pod{pod_uid}.slice/cri-containerd-{container}.scope\n"
    search = f"{namespace or 'default'}.svc.cluster.local svc.cluster.local cluster.local"
    return env, cgroup, f"search {search}\nnameserver 10.96.0.10\noptions ndots:5\n"
