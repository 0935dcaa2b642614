"""NVML calls that gpufleet's reader does not make but other monitoring tools do (nvitop, gpustat,
nvitop-exporter), so that they run unmodified on simulated GPUs.

A mixin of SimNvml: every method uses its device lookup, lock and timeline, and answers with the types,
units and errors nvidia-ml-py's own wrappers return.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpufleet.agent.sim import physics as ph

# Compute capability by architecture, as nvmlDeviceGetCudaComputeCapability reports it.
_COMPUTE_CAPABILITY = {
    pynvml.NVML_DEVICE_ARCH_AMPERE: (8, 0),
    pynvml.NVML_DEVICE_ARCH_ADA: (8, 9),
    pynvml.NVML_DEVICE_ARCH_HOPPER: (9, 0),
}
# nvmlDeviceGetEncoder/DecoderUtilization's sampling period on data-centre boards, microseconds.
_CODEC_PERIOD_US = 167_000


class ToolCalls:
    """Library, device and process queries of nvidia-ml-py that monitoring tools call."""

    # Provided by SimNvml.
    _device: Any
    _lock: Any
    _timeline: Any
    _model: Any
    _pids: Any
    _spec: Any
    _uuids: Any
    _handle: Any
    _clock: Any

    def nvmlInitWithFlags(self, flags: int) -> None:
        """nvmlInit with flags; the simulator has no GPU it could fail to attach, so flags change nothing."""
        return self.nvmlInit()  # type: ignore[attr-defined]

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        index, _ = self._device(handle)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        self._require_init()  # type: ignore[attr-defined]
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if text not in self._uuids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self.nvmlDeviceGetHandleByIndex(self._uuids.index(text))  # type: ignore[attr-defined]

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        """The unversioned call (nvidia-ml-py before 12.570 and most tools)."""
        return self.nvmlDeviceGetTemperatureV(handle, sensor)  # type: ignore[attr-defined]

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        """Power over the last second, milliwatts."""
        index, t = self._device(handle)
        with self._lock:
            rates = self._timeline.mean(index, t - 1.0, t)
        return int(round(1000 * rates[ph.POWER_W]))

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        """The configured limit, milliwatts (a scenario's power cap is the enforced one)."""
        self._device(handle)
        return int(round(1000 * self._model.tdp_watts))

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        self._device(handle)
        return int(round(1000 * self._model.tdp_watts))

    def nvmlDeviceGetPcieThroughput(self, handle: Any, counter: int) -> int:
        """PCIe bytes over the last second, KiB/s as NVML reports them."""
        index, t = self._device(handle)
        slot = {pynvml.NVML_PCIE_UTIL_TX_BYTES: ph.PCIE_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES: ph.PCIE_RX_BYTES}.get(
            counter
        )
        if slot is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            rates = self._timeline.mean(index, t - 1.0, t)
        return int(rates[slot] // 1024)

    def nvmlDeviceGetFanSpeed(self, handle: Any) -> int:
        """Passively cooled data-centre boards have no fan of their own: NVML says NOT_SUPPORTED."""
        self._device(handle)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetNumFans(self, handle: Any) -> int:
        self._device(handle)
        return 0

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        """[utilization %, sampling period µs]: training jobs do not use the video engines."""
        self._device(handle)
        return [0, _CODEC_PERIOD_US]

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        self._device(handle)
        return [0, _CODEC_PERIOD_US]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self.nvmlDeviceGetComputeRunningProcesses(handle)  # type: ignore[attr-defined]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        """No graphics contexts on a compute node."""
        self._device(handle)
        return []

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self.nvmlDeviceGetGraphicsRunningProcesses(handle)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._device(handle)
        return []

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self.nvmlDeviceGetMPSComputeRunningProcesses(handle)

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """One sample for the job's process; NOT_FOUND when no process ran since timeStamp (as NVML)."""
        index, t = self._device(handle)
        with self._lock:
            state = self._timeline.state(index, t)
            rates = self._timeline.mean(index, t - 1.0, t)
        now_us = int(self._clock() * 1e6)
        if state.job is None or now_us <= timeStamp:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        sample = pynvml.c_nvmlProcessUtilizationSample_t()
        sample.pid = self._pids[(state.job, index)]
        sample.timeStamp = now_us
        sample.smUtil = int(round(100 * rates[ph.UTIL]))
        sample.memUtil = int(round(100 * rates[ph.MEM_UTIL]))
        sample.encUtil = 0
        sample.decUtil = 0
        return [sample]

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        self._device(handle)
        capability = _COMPUTE_CAPABILITY.get(self._model.architecture)
        if capability is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return capability

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        self._device(handle)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        self._device(handle)
        return pynvml.NVML_COMPUTEMODE_DEFAULT

    def nvmlDeviceGetDisplayMode(self, handle: Any) -> int:
        self._device(handle)
        return pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetDisplayActive(self, handle: Any) -> int:
        self._device(handle)
        return pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        """P0 while a job runs, P0 at idle too: data-centre boards stay in P0 and drop clocks instead."""
        self._device(handle)
        return pynvml.NVML_PSTATE_0
