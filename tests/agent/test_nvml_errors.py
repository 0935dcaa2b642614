"""The NVML error vocabulary: labels, library-fatal codes, thread-safe counts."""

from __future__ import annotations

import threading

import pynvml
import pytest

from gpufleet.agent.nvml_errors import ErrorCounts, error_code, error_name, is_library_fatal


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, "not_supported"),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "not_supported"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
        (pynvml.NVML_ERROR_TIMEOUT, "timeout"),
        (pynvml.NVML_ERROR_UNKNOWN, "unknown"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, "gpu_is_lost"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found"),
        (pynvml.NVML_ERROR_UNINITIALIZED, "uninitialized"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "driver_library_mismatch"),
        (pynvml.NVML_ERROR_INSUFFICIENT_POWER, "other"),
        (None, "other"),
    ],
)
def test_error_names(code, name):
    assert error_name(code) == name


def test_error_code_of_pynvml_exceptions_only():
    assert error_code(pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)) == pynvml.NVML_ERROR_TIMEOUT
    assert error_code(pynvml.NVMLError_GpuIsLost()) == pynvml.NVML_ERROR_GPU_IS_LOST
    odd = ValueError("x")
    odd.value = 3  # type: ignore[attr-defined]
    assert error_code(odd) is None


def test_library_fatal_codes():
    fatal = [
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    ]
    assert all(is_library_fatal(code) for code in fatal)
    assert not any(is_library_fatal(c) for c in (None, pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_TIMEOUT))


def test_error_counts_from_many_threads():
    counts = ErrorCounts()
    threads = [
        threading.Thread(target=lambda: [counts.add("power_watts", "timeout") for _ in range(1000)]) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = counts.snapshot()
    counts.add("power_watts", "timeout")
    assert snapshot == {("power_watts", "timeout"): 4000}
