"""MIG: whether a GPU is split into GPU instances, and each instance's memory and GPM activity.

nvmlDeviceGetMigMode costs about 160 us of CPU a call (H200, driver 580), and a GPU enters or leaves MIG
mode only through a GPU reset, so the mode and the instances (which an operator may create or destroy while
the mode holds) are read at open and then every REDISCOVER_SECONDS, not every cycle. Each instance's memory
and GPM activity are read when the sampling tiers say (agent.tiers; its read unit is MIG_UNIT, costed at
open like any other). The NVML calls go through the reader's guard, so a failure counts and logs as any
reading's does and NotSupported retires the reading on that GPU: `mig_mode` (the mode and the instances),
`mig_memory`, `mig_activity`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import pynvml

from gpufleet.agent.gpm import GpmSampler
from gpufleet.agent.nvml_calls import text
from gpufleet.agent.nvml_errors import SUCCESS, error_code
from gpufleet.agent.nvml_values import INVALID, convert
from gpufleet.agent.sample_parts import MigInstance

MIG_MODE = "mig_mode"
MIG_MEMORY = "mig_memory"
MIG_ACTIVITY = "mig_activity"
MIG_UNIT = MIG_MEMORY  # the read unit of agent.tiers: an instance's memory and activity together
REDISCOVER_SECONDS = 60.0
_PROFILE_MARK = " MIG "

# readings, function, arguments -> the function's answer, or None after the reader handled its failure.
Guard = Callable[..., Any]


class MigGpu:
    """One GPU's MIG mode, its instances' handles and GPM buffers, and their last readings."""

    def __init__(self, nvml: Any, handle: Any, call: Guard, supported: Mapping[str, bool], *, gpm: bool) -> None:
        self._nvml = nvml
        self._handle = handle
        self._call = call
        self._supported = supported  # the reader's live view: a reading found unsupported is not asked again
        self._gpm = gpm
        self.enabled: bool | None = None
        self._slots: tuple[_Slot, ...] = ()
        self.instances: tuple[MigInstance, ...] = ()

    def discover(self) -> None:
        """Read the mode; in MIG mode list the instances anew (ids, profile, UUID), else forget them."""
        if not self._supported.get(MIG_MODE, True) or not _has_mig_calls(self._nvml):
            return  # a pynvml older than MIG (or a stand-in without it): no MIG, as on a board without it
        mode = self._call((MIG_MODE,), self._nvml.nvmlDeviceGetMigMode, self._handle)
        if mode is None:
            return  # unsupported now, or a transient failure: what was known stays
        self.enabled = int(mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE
        found = self._list() if self.enabled else ()
        if [s.key for s in found] != [s.key for s in self._slots]:
            self.free()
            self._slots = tuple(found)
            self.instances = tuple(s.identity for s in found)

    def read(self) -> None:
        """Each instance's memory and (where the driver gives it) GPM activity."""
        out = []
        for slot in self._slots:
            memory = self._memory(slot)
            activity = self._activity(slot)
            out.append(slot.reading(memory, activity))
        self.instances = tuple(out)

    def free(self) -> None:
        """Release the instances' GPM buffers."""
        for slot in self._slots:
            if slot.gpm is not None:
                slot.gpm.free()
        self._slots, self.instances = (), ()

    # -- discovery -----------------------------------------------------------------------------------

    def _list(self) -> list[_Slot]:
        count = self._call((MIG_MODE,), self._nvml.nvmlDeviceGetMaxMigDeviceCount, self._handle) or 0
        out = []
        for index in range(int(count)):
            handle = self._call((MIG_MODE,), _handle_at, self._nvml, self._handle, index)
            if handle is None:
                continue
            gi = self._call((MIG_MODE,), self._nvml.nvmlDeviceGetGpuInstanceId, handle)
            if gi is None:
                continue
            ci = self._call((MIG_MODE,), self._nvml.nvmlDeviceGetComputeInstanceId, handle)
            name = self._call((MIG_MODE,), self._nvml.nvmlDeviceGetName, handle)
            uuid = self._call((MIG_MODE,), self._nvml.nvmlDeviceGetUUID, handle)
            identity = MigInstance(
                int(gi),
                None if ci is None else int(ci),
                profile_of(None if name is None else text(name)),
                None if uuid is None else text(uuid),
            )
            out.append(_Slot(handle, identity, self._sampler(int(gi))))
        return out

    def _sampler(self, gpu_instance_id: int) -> GpmSampler | None:
        if not self._gpm or not self._supported.get(MIG_ACTIVITY, True):
            return None
        nvml = _InstanceGpm(self._nvml, gpu_instance_id)
        return self._call((MIG_ACTIVITY,), GpmSampler, nvml, self._handle)

    # -- reading -------------------------------------------------------------------------------------

    def _memory(self, slot: _Slot) -> Any:
        if not self._supported.get(MIG_MEMORY, True):
            return None
        return self._call((MIG_MEMORY,), self._nvml.nvmlDeviceGetMemoryInfo, slot.handle)

    def _activity(self, slot: _Slot) -> Mapping[str, float]:
        if slot.gpm is None:
            return slot.identity.activity
        if not self._supported.get(MIG_ACTIVITY, True):
            slot.gpm.free()
            slot.gpm = None
            return slot.identity.activity
        result = self._call((MIG_ACTIVITY,), slot.gpm.sample)
        if result is None:  # the first sample, or a failure: the last values stand until the next
            return slot.last_activity
        values = {}
        for reading, (code, raw) in result.items():
            value = convert(reading, raw) if code == SUCCESS and raw is not None else INVALID
            if value is not INVALID:
                values[reading] = value
        slot.last_activity = MappingProxyType(values)
        return slot.last_activity


class _Slot:
    """One instance as discovered: its handle, identity and GPM sampler; its last activity."""

    def __init__(self, handle: Any, identity: MigInstance, gpm: GpmSampler | None) -> None:
        self.handle = handle
        self.identity = identity
        self.gpm = gpm
        self.last_activity: Mapping[str, float] = identity.activity

    @property
    def key(self) -> tuple[Any, ...]:
        i = self.identity
        return (i.gpu_instance_id, i.compute_instance_id, i.profile, i.uuid)

    def reading(self, memory: Any, activity: Mapping[str, float]) -> MigInstance:
        i = self.identity
        used = None if memory is None else int(memory.used)
        total = None if memory is None else int(memory.total)
        return MigInstance(i.gpu_instance_id, i.compute_instance_id, i.profile, i.uuid, used, total, activity)


class _InstanceGpm:
    """The NVML object a GpmSampler sees for one GPU instance: its samples are the instance's."""

    def __init__(self, nvml: Any, gpu_instance_id: int) -> None:
        self._nvml = nvml
        self._gi = gpu_instance_id

    def nvmlGpmSampleGet(self, device: Any, sample: Any) -> Any:
        return self._nvml.nvmlGpmMigSampleGet(device, self._gi, sample)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nvml, name)


def _has_mig_calls(nvml: Any) -> bool:
    return all(getattr(nvml, name, None) is not None for name in _MIG_CALLS)


_MIG_CALLS = (
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
)


def _handle_at(nvml: Any, parent: Any, index: int) -> Any:
    """The MIG device at `index`, or None for an empty index (NotFound: no instance there, not an error)."""
    try:
        return nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
    except pynvml.NVMLError as exc:
        if error_code(exc) == pynvml.NVML_ERROR_NOT_FOUND:
            return None
        raise


def profile_of(name: str | None) -> str | None:
    """The profile of a MIG device's name: "NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb"."""
    if not name or _PROFILE_MARK not in name:
        return None
    return name.rsplit(_PROFILE_MARK, 1)[1].strip() or None
