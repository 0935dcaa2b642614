"""The simulator installed as the `pynvml` module itself, for programs that are not gpufleet.

nvidia-ml-py's public functions are replaced by a SimNvml's methods of the same name, and its loaded C
library by SimNvmlLib: tools that reach past the Python wrappers (nvitop looks up versioned C symbols
through `pynvml._nvmlGetFunctionPointer` and calls them with ctypes arguments) find the simulator
there too, and symbols it does not answer are missing, as in an older driver (NVMLError_FunctionNotFound).

This module must not import pynvml at import time: the shim that calls it is itself named pynvml and
hands over the real module once it has loaded it.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import types
from typing import Any, Callable

# Environment of a program started by gpufleet.agent.sim.run; the shim reads it.
ENV_SCENARIO = "GPUFLEET_SIM_SCENARIO"
ENV_NODE = "GPUFLEET_SIM_NODE"
ENV_SEED = "GPUFLEET_SIM_SEED"
ENV_EPOCH = "GPUFLEET_SIM_EPOCH"

# The generated pynvml.py: load the real nvidia-ml-py from the rest of sys.path, then hand it to
# install_from_environment. Kept free of gpufleet imports until the real module is in sys.modules,
# because gpufleet's simulator imports pynvml for its structures and constants.
SHIM_SOURCE = '''\
"""pynvml answered by gpufleet's NVML simulator (written by gpufleet.agent.sim.run)."""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("pynvml", _path)
if _spec is None or _spec.loader is None:
    raise ImportError("gpufleet simulator: nvidia-ml-py (module pynvml) is not installed for " + sys.executable)
_real = importlib.util.module_from_spec(_spec)
sys.modules["pynvml"] = _real
_spec.loader.exec_module(_real)

from gpufleet.agent.sim.dropin import install_from_environment  # noqa: E402

install_from_environment(_real)
'''


def install_from_environment(module: types.ModuleType) -> Any:
    """Build the SimNvml that the GPUFLEET_SIM_* variables describe and install it into `module`."""
    from gpufleet.agent.sim import SimNvml, load_scenario

    scenario = load_scenario(os.environ[ENV_SCENARIO])
    node = os.environ.get(ENV_NODE) or scenario.nodes[0]
    epoch = os.environ.get(ENV_EPOCH)
    sim = SimNvml(scenario, node=node, epoch=float(epoch) if epoch else None, seed=int(os.environ.get(ENV_SEED) or 0))
    install(sim, module)
    return sim


def install(sim: Any, module: types.ModuleType) -> None:
    """Make nvidia-ml-py's module `module` answer from `sim`: its wrappers and its C library."""
    for name in dir(type(sim)):
        if not name.startswith("nvml") or not inspect.isfunction(getattr(type(sim), name)):
            continue
        if isinstance(getattr(module, name, None), types.FunctionType):
            setattr(module, name, getattr(sim, name))
    module.nvmlLib = SimNvmlLib(sim, module)  # type: ignore[attr-defined]
    cache = getattr(module, "_nvmlGetFunctionPointer_cache", None)
    if isinstance(cache, dict):
        cache.clear()


def _target(arg: Any) -> Any:
    """The object a ctypes byref()/pointer() argument points at (the argument itself otherwise)."""
    obj = getattr(arg, "_obj", None)  # ctypes.byref
    if obj is not None:
        return obj
    if isinstance(arg, ctypes._Pointer):
        return arg.contents
    return arg


def _int(arg: Any) -> int:
    return int(getattr(arg, "value", arg))


class SimNvmlLib:
    """The C symbols of libnvidia-ml that tools call directly, with C conventions: ctypes arguments
    in and out, an NVML return code as the result."""

    def __init__(self, sim: Any, module: types.ModuleType) -> None:
        self._sim = sim
        self._nvml = module
        # What the simulator raises: the nvidia-ml-py it was built on (the same module under the shim).
        self._error = type(sim).NVMLError
        self._symbols: dict[str, Callable[..., int]] = {
            "nvmlInit_v2": lambda: self._call(sim.nvmlInit),
            "nvmlInitWithFlags": lambda flags: self._call(sim.nvmlInitWithFlags, _int(flags)),
            "nvmlShutdown": lambda: self._call(sim.nvmlShutdown),
            "nvmlDeviceGetMemoryInfo": self._memory_v1,
            "nvmlDeviceGetMemoryInfo_v2": self._memory_v2,
            "nvmlDeviceGetTemperature": self._temperature,
            "nvmlDeviceGetTemperatureV": self._temperature_v,
            "nvmlDeviceGetFieldValues": self._field_values,
            # Linux has no Windows driver models: the driver answers NOT_SUPPORTED.
            "nvmlDeviceGetDriverModel": lambda *_: module.NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetDriverModel_v2": lambda *_: module.NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetComputeRunningProcesses_v3": lambda h, n, out: self._processes(
                sim.nvmlDeviceGetComputeRunningProcesses, h, n, out
            ),
            "nvmlDeviceGetGraphicsRunningProcesses_v3": lambda h, n, out: self._processes(
                sim.nvmlDeviceGetGraphicsRunningProcesses, h, n, out
            ),
            "nvmlDeviceGetMPSComputeRunningProcesses_v3": lambda h, n, out: self._processes(
                sim.nvmlDeviceGetMPSComputeRunningProcesses, h, n, out
            ),
        }

    def __getattr__(self, name: str) -> Callable[..., int]:
        # pynvml turns AttributeError into NVMLError_FunctionNotFound, as for a driver without the symbol.
        try:
            return self.__dict__["_symbols"][name]
        except KeyError:
            raise AttributeError(name) from None

    def _call(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            fn(*args)
        except self._error as exc:
            return int(exc.value)
        return self._nvml.NVML_SUCCESS

    def _returning(self, fn: Callable[..., Any], *args: Any) -> tuple[int, Any]:
        try:
            return self._nvml.NVML_SUCCESS, fn(*args)
        except self._error as exc:
            return int(exc.value), None

    @staticmethod
    def _copy_fields(src: Any, dst: Any, skip: tuple[str, ...] = ("version",)) -> None:
        for name, _ in type(dst)._fields_:
            if name not in skip and hasattr(src, name):
                setattr(dst, name, getattr(src, name))

    def _memory_v1(self, handle: Any, out: Any) -> int:
        ret, info = self._returning(self._sim.nvmlDeviceGetMemoryInfo, handle)
        if ret == self._nvml.NVML_SUCCESS:
            self._copy_fields(info, _target(out))
        return ret

    def _memory_v2(self, handle: Any, out: Any) -> int:
        dst = _target(out)
        ret, info = self._returning(self._sim.nvmlDeviceGetMemoryInfo, handle, dst.version)
        if ret == self._nvml.NVML_SUCCESS:
            self._copy_fields(info, dst)
        return ret

    def _temperature(self, handle: Any, sensor: Any, out: Any) -> int:
        ret, value = self._returning(self._sim.nvmlDeviceGetTemperature, handle, _int(sensor))
        if ret == self._nvml.NVML_SUCCESS:
            _target(out).value = value
        return ret

    def _temperature_v(self, handle: Any, out: Any) -> int:
        dst = _target(out)
        ret, value = self._returning(self._sim.nvmlDeviceGetTemperatureV, handle, dst.sensorType, dst.version)
        if ret == self._nvml.NVML_SUCCESS:
            dst.temperature = value
        return ret

    def _field_values(self, handle: Any, count: Any, out: Any) -> int:
        dst = _target(out)
        n = _int(count)
        if n <= 0:
            return self._nvml.NVML_ERROR_INVALID_ARGUMENT
        ids = [(dst[i].fieldId, dst[i].scopeId) for i in range(n)]
        ret, values = self._returning(self._sim.nvmlDeviceGetFieldValues, handle, ids)
        if ret == self._nvml.NVML_SUCCESS:
            size = ctypes.sizeof(values) // n
            ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(values), size * n)
        return ret

    def _processes(self, fn: Callable[[Any], list[Any]], handle: Any, count: Any, out: Any) -> int:
        """NVML's two-call protocol: the count alone first (INSUFFICIENT_SIZE), then the array."""
        ret, processes = self._returning(fn, handle)
        if ret != self._nvml.NVML_SUCCESS:
            return ret
        slot = _target(count)
        room = slot.value
        slot.value = len(processes)
        if not processes:
            return self._nvml.NVML_SUCCESS
        if out is None or room < len(processes):
            return self._nvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, process in enumerate(processes):
            self._copy_fields(process, out[i], skip=())
        return self._nvml.NVML_SUCCESS
