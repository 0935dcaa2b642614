"""One place that decides what an NVML failure means for the agent.

NVML reports failures as numeric return codes (raised by pynvml as NVMLError subclasses, or carried per
entry by nvmlDeviceGetFieldValues). The reader needs a small, stable vocabulary for them: a label for the
error counters, whether the reading is unsupported for good, whether the GPU is gone, and whether the
library as a whole is unusable. The codes are the C enum values, stable across NVML versions.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import MappingProxyType
from typing import Mapping

import pynvml

SUCCESS = 0
_UNINITIALIZED = 1
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_UNKNOWN = 999

NOT_SUPPORTED = "not_supported"
NO_PERMISSION = "no_permission"
TIMEOUT = "timeout"
UNKNOWN = "unknown"
GPU_IS_LOST = "gpu_is_lost"
INVALID_VALUE = "invalid_value"
OTHER = "other"
# Why NVML as a whole is unusable; the init error counter says which, so a dashboard need not read logs.
DRIVER_NOT_LOADED = "driver_not_loaded"
LIBRARY_NOT_FOUND = "library_not_found"
UNINITIALIZED = "uninitialized"
DRIVER_MISMATCH = "driver_library_mismatch"

# A driver too old to export a function cannot gain it while we run: as final as "not supported".
_NAMES = {
    _NOT_SUPPORTED: NOT_SUPPORTED,
    _FUNCTION_NOT_FOUND: NOT_SUPPORTED,
    _NO_PERMISSION: NO_PERMISSION,
    _TIMEOUT: TIMEOUT,
    _UNKNOWN: UNKNOWN,
    _GPU_IS_LOST: GPU_IS_LOST,
    _DRIVER_NOT_LOADED: DRIVER_NOT_LOADED,
    _LIBRARY_NOT_FOUND: LIBRARY_NOT_FOUND,
    _UNINITIALIZED: UNINITIALIZED,
    _LIB_RM_VERSION_MISMATCH: DRIVER_MISMATCH,
}

# These mean the library itself is gone (driver unloaded or replaced, never initialised): no per-GPU
# handling helps, the caller has to shut down and initialise again.
_LIBRARY_FATAL = frozenset({_UNINITIALIZED, _DRIVER_NOT_LOADED, _LIBRARY_NOT_FOUND, _LIB_RM_VERSION_MISMATCH})


def error_code(exc: BaseException) -> int | None:
    """The NVML return code an exception carries, or None for a non-NVML exception."""
    if not isinstance(exc, pynvml.NVMLError):
        return None
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def error_name(code: int | None) -> str:
    """The counter label for an NVML return code (None: a non-NVML failure)."""
    if code is None:
        return OTHER
    return _NAMES.get(code, OTHER)


def is_library_fatal(code: int | None) -> bool:
    """True when the code says NVML as a whole is unusable until re-initialised."""
    return code in _LIBRARY_FATAL


class ErrorCounts:
    """Cumulative (reading, error name) counts, safe to bump from the XID thread and the sampler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, reading: str, name: str) -> None:
        """Count one failure of `reading`."""
        with self._lock:
            self._counts[(reading, name)] += 1

    def snapshot(self) -> Mapping[tuple[str, str], int]:
        """An immutable copy of the counts."""
        with self._lock:
            return MappingProxyType(dict(self._counts))
