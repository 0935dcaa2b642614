"""NvmlReader against a programmable fake NVML: units, capabilities, and every failure mode per reading."""

from __future__ import annotations

import logging
import math

import pynvml
import pytest

from gpufleet.agent.nvml_reader import NvmlReader, NvmlUnavailable
from tests.agent.fake_nvml import FakeNvml, FakeGpu, h100

FIELD_SCOPE = 0xFFFFFFFF
ERRORS = {
    "not_supported": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "no_permission": pynvml.NVML_ERROR_NO_PERMISSION,
    "timeout": pynvml.NVML_ERROR_TIMEOUT,
    "unknown": pynvml.NVML_ERROR_UNKNOWN,
    "gpu_is_lost": pynvml.NVML_ERROR_GPU_IS_LOST,
}

# Per-poll NVML call -> (handle-bound?, the GpuSample fields it feeds, the error-counter readings).
POLLED = {
    "nvmlDeviceGetUtilizationRates": (True, ("utilization_ratio", "memory_utilization_ratio")),
    "nvmlDeviceGetTemperatureV": (True, ("temperature_celsius",)),
    "nvmlDeviceGetClockInfo": (True, ("sm_clock_hertz", "memory_clock_hertz")),
    "nvmlDeviceGetCurrentClocksEventReasons": (True, ("throttle_reasons",)),
    "nvmlDeviceGetMemoryInfo": (True, ("memory_used_bytes", "memory_total_bytes")),
    "nvmlDeviceGetEnforcedPowerLimit": (True, ("power_limit_watts",)),
    "nvmlDeviceGetTotalEccErrors": (True, ("ecc_corrected_errors_total", "ecc_uncorrected_errors_total")),
    "nvmlDeviceGetRemappedRows": (
        True,
        ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure"),
    ),
    "nvmlDeviceGetFanSpeed": (True, ("fan_speed_ratio",)),
    "nvmlDeviceGetPerformanceState": (True, ("performance_state",)),
    "nvmlDeviceGetEncoderUtilization": (True, ("encoder_utilization_ratio",)),
    "nvmlDeviceGetDecoderUtilization": (True, ("decoder_utilization_ratio",)),
    "nvmlDeviceGetPowerManagementLimit": (True, ("power_management_limit_watts",)),
    "nvmlDeviceGetPcieReplayCounter": (True, ("pcie_replays_total",)),
    "nvmlDeviceGetFieldValues": (
        True,
        (
            "power_watts",
            "energy_joules_total",
            "memory_temperature_celsius",
            "pcie_tx_bytes_total",
            "pcie_rx_bytes_total",
            "nvlink_tx_bytes_total",
            "nvlink_rx_bytes_total",
        ),
    ),
    "nvmlGpmSampleGet": (True, ("sm_active_ratio", "sm_occupancy_ratio")),
    "nvmlGpmMetricsGet": (False, ("sm_active_ratio", "sm_occupancy_ratio")),
}


def opened(fake: FakeNvml, **kwargs) -> NvmlReader:
    reader = NvmlReader(fake, xid_wait_ms=20, **kwargs)
    reader.open()
    return reader


@pytest.fixture
def two_gpus():
    fake = FakeNvml([h100(0, links=4), h100(1, links=4)])
    reader = opened(fake)
    yield fake, reader
    reader.close()


def no_other_errors(reader: NvmlReader) -> bool:
    """'other' means a call the fake does not implement (e.g. a deprecated one) or a reader bug."""
    return not [key for key in reader.errors if key[1] == "other"]


def test_units_are_converted_exactly():
    fake = FakeNvml([h100(0, links=2)])
    reader = opened(fake, per_link_nvlink=True)
    reader.read()
    (gpu,) = reader.read()
    reader.close()
    assert gpu.up and gpu.uuid == "GPU-00000000-h100" and gpu.model == "NVIDIA H100 80GB HBM3"
    assert (gpu.pci_bus_id, gpu.serial, gpu.vbios_version) == ("00000000:18:00.0", "1650000000001", "96.00.99.00.01")
    assert (gpu.utilization_ratio, gpu.memory_utilization_ratio) == (0.98, 0.41)
    assert (gpu.sm_active_ratio, gpu.sm_occupancy_ratio) == (0.81, 0.405)
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (47_036_445_491, 85_520_809_984)
    assert (gpu.temperature_celsius, gpu.memory_temperature_celsius) == (71.0, 78.0)
    assert gpu.slowdown_temperature_celsius == 87.0 and gpu.shutdown_temperature_celsius == 92.0
    assert gpu.max_operating_temperature_celsius == 85.0 and gpu.memory_max_operating_temperature_celsius == 95.0
    assert (gpu.power_watts, gpu.power_limit_watts) == (655.0, 700.0)
    assert gpu.energy_joules_total == 2_225_020_545.4
    assert (gpu.sm_clock_hertz, gpu.sm_clock_max_hertz) == (1_755_000_000.0, 1_980_000_000.0)
    assert (gpu.memory_clock_hertz, gpu.memory_clock_max_hertz) == (2_619_000_000.0, 2_619_000_000.0)
    assert gpu.throttle_reasons == 0
    assert dict(gpu.throttle_seconds_total) == {
        "sw_power_cap": 1.5,
        "sw_thermal_slowdown": 0.25,
        "hw_thermal_slowdown": 0.0,
        "hw_power_brake_slowdown": 7e-9,
        "sync_boost": 0.0,
    }
    assert gpu.nvlink_tx_bytes_total == 71_873_845_680 * 1024
    assert gpu.nvlink_rx_bytes_total == 79_247_496_774 * 1024
    assert gpu.nvlink_link_tx_bytes_total == (1000 * 1024, 1001 * 1024)
    assert gpu.nvlink_link_rx_bytes_total == (2000 * 1024, 2001 * 1024)
    assert (gpu.pcie_tx_bytes_total, gpu.pcie_rx_bytes_total) == (435_114_117_676, 293_621_035_166)
    assert (gpu.ecc_corrected_errors_total, gpu.ecc_uncorrected_errors_total) == (3, 0)
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (2, 0)
    assert (gpu.remapped_rows_pending, gpu.remapped_rows_failure) == (False, False)
    assert (gpu.xid_errors_total, dict(gpu.xid_errors_by_code), gpu.last_xid) == (0, {}, None)
    assert gpu.counter_resets == () and gpu.hpc_job is None
    assert (reader.driver_version, reader.nvml_version, reader.cuda_driver_version) == (
        "550.54.15",
        "12.550.54.15",
        "12.4",
    )
    assert dict(reader.errors) == {}


def test_per_link_counters_are_off_by_default(two_gpus):
    fake, reader = two_gpus
    gpu = reader.read()[0]
    assert gpu.nvlink_link_tx_bytes_total == () and gpu.nvlink_link_rx_bytes_total == ()
    assert all(scope in (0, FIELD_SCOPE) for _, request in fake.field_requests for _, scope in request)


def test_only_current_nvml_calls_are_made(two_gpus):
    fake, reader = two_gpus
    reader.read()
    reader.read()
    deprecated = {
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetViolationStatus",
        "nvmlDeviceGetNvLinkUtilizationCounter",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetDetailedEccErrors",
    }
    assert not deprecated & {name for name, _ in fake.calls}
    assert no_other_errors(reader)


def test_one_field_value_call_per_gpu_per_poll(two_gpus):
    fake, reader = two_gpus
    before = fake.called("nvmlDeviceGetFieldValues")
    reader.read()
    assert fake.called("nvmlDeviceGetFieldValues") - before == 2


def test_first_gpm_poll_after_open_is_none_then_values(two_gpus):
    _, reader = two_gpus
    first = reader.read()[0]
    second = reader.read()[0]
    assert first.sm_active_ratio is None and first.sm_occupancy_ratio is None
    assert second.sm_active_ratio == 0.81


@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("function", sorted(POLLED))
def test_each_error_on_each_polled_reading(two_gpus, function, error):
    fake, reader = two_gpus
    handle_bound, fields = POLLED[function]
    reader.read()  # GPM now has its previous sample
    times = 2 if function in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetTotalEccErrors") else 1  # SM+MEM, corr+unc
    fake.inject(function, ERRORS[error], index=0 if handle_bound else None, times=times)
    gpu0, gpu1 = reader.read()
    if error == "gpu_is_lost":
        assert not gpu0.up and gpu0.uuid == "GPU-00000000-h100" and gpu0.utilization_ratio is None
        assert gpu0.pci_bus_id == "00000000:18:00.0" and gpu0.power_watts is None and gpu0.sm_active_ratio is None
    else:
        assert gpu0.up
        assert all(getattr(gpu0, name) is None for name in fields), fields
        assert gpu0.temperature_celsius is not None or function == "nvmlDeviceGetTemperatureV"
    assert reader.errors[(fields[0], error)] == 1
    assert gpu1.up and all(getattr(gpu1, name) is not None for name in fields)
    where = 0 if handle_bound else None
    calls_on_0 = fake.called(function, where)
    again, _ = reader.read()
    if error == "not_supported":
        assert reader.capabilities[0][fields[0]] is False
        assert getattr(again, fields[0]) is None
        if handle_bound:
            assert fake.called(function, 0) == calls_on_0
    elif error == "gpu_is_lost":
        assert not again.up
        if handle_bound:
            assert fake.called(function, 0) == calls_on_0
    else:  # transient: back on the next poll (GPM: once it has two good samples again)
        assert reader.capabilities[0][fields[0]] is True
        if function == "nvmlGpmSampleGet":
            assert again.sm_active_ratio is None
            again, _ = reader.read()
        assert getattr(again, fields[-1]) is not None
    assert no_other_errors(reader)


def test_gpu_lost_mid_run_others_keep_reporting(two_gpus, caplog):
    fake, reader = two_gpus
    reader.read()
    fake.gpus[0].lost = True
    caplog.set_level(logging.WARNING, logger="gpufleet.agent.nvml_reader")
    samples = [reader.read() for _ in range(3)]
    calls_on_0 = fake.called("nvmlDeviceGetUtilizationRates", 0)
    reader.read()
    assert fake.called("nvmlDeviceGetUtilizationRates", 0) == calls_on_0
    for gpu0, gpu1 in samples:
        assert not gpu0.up and gpu0.model == "NVIDIA H100 80GB HBM3" and gpu0.temperature_celsius is None
        assert gpu0.xid_errors_total is None and gpu0.counter_resets == ()
        assert gpu1.up and gpu1.power_watts == 655.0
    assert len([r for r in caplog.records if "gpu lost" in r.getMessage()]) == 1
    assert reader.errors[("utilization_ratio", "gpu_is_lost")] == 1
    assert reader.compute_pids(0) == ()


def test_gpu_lost_before_open_is_reported_down():
    fake = FakeNvml([h100(0), h100(1)])
    fake.inject("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_GPU_IS_LOST, index=1)
    reader = opened(fake)
    gpu0, gpu1 = reader.read()
    reader.close()
    assert gpu0.up and not gpu1.up and gpu1.index == 1 and gpu1.uuid == ""
    assert reader.errors[("device", "gpu_is_lost")] == 1


def test_init_failing_then_recovering():
    fake = FakeNvml([h100(0)])
    fake.init_failures = 2
    reader = NvmlReader(fake, xid_wait_ms=20)
    for _ in range(2):
        with pytest.raises(NvmlUnavailable):
            reader.open()
        with pytest.raises(NvmlUnavailable):
            reader.read()
    reader.open()
    (gpu,) = reader.read()
    reader.close()
    assert gpu.up and gpu.power_watts == 655.0
    assert reader.errors[("nvml_init", "driver_not_loaded")] == 2  # the fake's init error


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND]
)
def test_library_gone_during_read_raises_and_reopens(code):
    fake = FakeNvml([h100(0)])
    reader = opened(fake)
    reader.read()
    fake.inject("nvmlDeviceGetTemperatureV", code, index=0, times=1)
    with pytest.raises(NvmlUnavailable):
        reader.read()
    assert not fake.initialized and len(fake.freed_gpm_samples) == 2
    assert reader.capabilities == {}
    reader.open()
    (gpu,) = reader.read()
    reader.close()
    assert gpu.up and gpu.temperature_celsius == 71.0


def test_device_count_failure_is_unavailable_and_shuts_down():
    fake = FakeNvml([h100(0)])
    fake.inject("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN, times=1)
    reader = NvmlReader(fake, xid_wait_ms=20)
    with pytest.raises(NvmlUnavailable):
        reader.open()
    assert not fake.initialized
    reader.open()
    assert len(reader.read()) == 1
    reader.close()


def test_gpm_unsupported():
    fake = FakeNvml([FakeGpu(uuid="GPU-a100", name="NVIDIA A100-SXM4-80GB", gpm_supported=False, fields={})])
    reader = opened(fake)
    samples = [reader.read()[0] for _ in range(3)]
    reader.close()
    assert all(s.sm_active_ratio is None and s.sm_occupancy_ratio is None for s in samples)
    assert fake.called("nvmlGpmSampleAlloc") == 0 and fake.called("nvmlGpmSampleGet") == 0
    assert dict(reader.errors) == {}  # a GPU without GPM is normal, not an error


def test_gpm_metric_with_its_own_error_code():
    fake = FakeNvml([h100(0)])
    fake.gpus[0].gpm_codes[pynvml.NVML_GPM_METRIC_SM_OCCUPANCY] = pynvml.NVML_ERROR_NOT_SUPPORTED
    reader = opened(fake)
    reader.read()
    gpu = reader.read()[0]
    gpu_again = reader.read()[0]
    caps = reader.capabilities[0]
    reader.close()
    assert gpu.sm_active_ratio == 0.81 and gpu.sm_occupancy_ratio is None
    assert gpu_again.sm_active_ratio == 0.81
    assert caps["sm_occupancy_ratio"] is False and caps["sm_active_ratio"] is True
    assert reader.errors[("sm_occupancy_ratio", "not_supported")] == 1


def test_gpm_buffers_are_reused_and_freed():
    fake = FakeNvml([h100(0)])
    reader = opened(fake)
    for _ in range(5):
        reader.read()
    reader.close()
    assert fake.called("nvmlGpmSampleAlloc") == 2 and len(fake.freed_gpm_samples) == 2


def test_field_values_with_mixed_per_entry_return_codes(caplog):
    fake = FakeNvml([h100(0)])
    codes = fake.gpus[0].field_codes
    codes[(pynvml.NVML_FI_DEV_POWER_INSTANT, 0)] = pynvml.NVML_ERROR_NO_PERMISSION
    codes[(pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0)] = pynvml.NVML_ERROR_TIMEOUT
    codes[(pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0)] = pynvml.NVML_ERROR_UNKNOWN
    del fake.gpus[0].fields[(pynvml.NVML_FI_DEV_MEMORY_TEMP, 0)]  # answers NOT_SUPPORTED per entry
    caplog.set_level(logging.INFO, logger="gpufleet.agent.nvml_reader")
    reader = opened(fake)
    gpu = reader.read()[0]
    assert (gpu.power_watts, gpu.energy_joules_total, gpu.pcie_tx_bytes_total) == (None, None, None)
    assert gpu.memory_temperature_celsius is None
    assert gpu.pcie_rx_bytes_total == 293_621_035_166 and gpu.nvlink_tx_bytes_total is not None
    assert reader.errors[("power_watts", "no_permission")] == 2  # probe at open + first poll
    assert reader.errors[("energy_joules_total", "timeout")] == 2
    assert reader.errors[("pcie_tx_bytes_total", "unknown")] == 2
    assert ("memory_temperature_celsius", "not_supported") not in reader.errors  # found at open: not an error
    assert reader.capabilities[0]["memory_temperature_celsius"] is False
    assert reader.capabilities[0]["power_watts"] is True
    _, request = fake.field_requests[-1]
    assert (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0) not in request
    assert (pynvml.NVML_FI_DEV_POWER_INSTANT, 0) in request
    codes.clear()
    assert reader.read()[0].power_watts == 655.0
    reader.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage() == "nvml reading failed"]
    assert sorted(r.reading for r in warnings) == ["energy_joules_total", "pcie_tx_bytes_total", "power_watts"]


def test_unsupported_readings_logged_once_per_gpu(caplog):
    gpu = h100(0)
    gpu.serial = None
    del gpu.fields[(pynvml.NVML_FI_DEV_MEMORY_TEMP, 0)]
    fake = FakeNvml([gpu, h100(1)])
    fake.inject("nvmlDeviceGetSerial", pynvml.NVML_ERROR_NOT_SUPPORTED, index=0)
    fake.inject("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_NOT_SUPPORTED, index=0)
    caplog.set_level(logging.INFO, logger="gpufleet.agent.nvml_reader")
    reader = opened(fake)
    for _ in range(3):
        sample = reader.read()[0]
    lines = [r for r in caplog.records if r.getMessage() == "gpu readings unsupported"]
    assert len(lines) == 1 and lines[0].gpu == 0
    assert lines[0].unsupported == [
        "memory_temperature_celsius",
        "remapped_rows_correctable",
        "remapped_rows_failure",
        "remapped_rows_pending",
        "remapped_rows_uncorrectable",
        "serial",
    ]
    assert sample.serial is None and sample.remapped_rows_pending is None
    assert fake.called("nvmlDeviceGetRemappedRows", 0) == 1  # the probe, never a poll
    # Learned at poll time: one more line, once.
    fake.inject("nvmlDeviceGetEnforcedPowerLimit", pynvml.NVML_ERROR_NOT_SUPPORTED, index=0)
    for _ in range(3):
        reader.read()
    lines = [r for r in caplog.records if r.getMessage() == "gpu readings unsupported"]
    assert len(lines) == 2 and lines[1].unsupported == ["power_limit_watts"]
    reader.close()
    # A re-open (NVML recovered) does not repeat what was already reported.
    reader.open()
    reader.read()
    reader.close()
    lines = [r for r in caplog.records if r.getMessage() == "gpu readings unsupported"]
    assert len(lines) == 2


def test_pcie_card_without_nvlink_has_no_nvlink_readings():
    fields = {k: v for k, v in h100(0).fields.items() if k[0] != pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT}
    fields[(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0)] = 0
    fake = FakeNvml([FakeGpu(uuid="GPU-l40s", fields=fields)])
    reader = opened(fake, per_link_nvlink=True)
    gpu = reader.read()[0]
    capabilities = reader.capabilities[0]
    reader.close()
    assert gpu.nvlink_tx_bytes_total is None and gpu.nvlink_rx_bytes_total is None
    assert gpu.nvlink_link_tx_bytes_total == () and gpu.pcie_tx_bytes_total is not None
    assert capabilities["nvlink_tx_bytes_total"] is False
    assert not [k for k in fake.field_requests[-1][1] if k[0] == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX]


def test_counters_going_backwards_are_exported_and_flagged(two_gpus):
    fake, reader = two_gpus
    reader.read()
    fields = fake.gpus[0].fields
    fields[(pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0)] = 1_000
    fields[(pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0)] = 5
    fields[(pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP, 0)] = 0
    fake.gpus[0].ecc[pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED] = 0
    gpu0, gpu1 = reader.read()
    assert gpu0.energy_joules_total == 1.0 and gpu0.pcie_tx_bytes_total == 5
    assert gpu0.counter_resets == (
        "ecc_corrected_errors_total",
        "energy_joules_total",
        "pcie_tx_bytes_total",
        "throttle_seconds_total",
    )
    assert gpu1.counter_resets == ()
    assert reader.read()[0].counter_resets == ()


def test_counter_reset_across_driver_reload_is_flagged():
    fake = FakeNvml([h100(0)])
    reader = opened(fake)
    reader.read()
    reader.close()
    fake.gpus[0].fields[(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, FIELD_SCOPE)] = 10
    reader.open()
    gpu = reader.read()[0]
    reader.close()
    assert gpu.counter_resets == ("nvlink_rx_bytes_total",) and gpu.nvlink_rx_bytes_total == 10 * 1024


def test_per_link_counter_going_backwards_is_flagged():
    fake = FakeNvml([h100(0, links=2)])
    reader = opened(fake, per_link_nvlink=True)
    reader.read()
    fake.gpus[0].fields[(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 1)] = 3
    gpu = reader.read()[0]
    reader.close()
    assert gpu.nvlink_link_tx_bytes_total == (1000 * 1024, 3 * 1024)
    assert gpu.counter_resets == ("nvlink_link_tx_bytes_total",)


@pytest.mark.parametrize(
    ("mutate", "field", "reading"),
    [
        (lambda g: setattr(g, "utilization", (101, 40)), "utilization_ratio", "utilization_ratio"),
        (lambda g: setattr(g, "temperature", 200), "temperature_celsius", "temperature_celsius"),
        (lambda g: setattr(g, "temperature", -41), "temperature_celsius", "temperature_celsius"),
        (lambda g: g.fields.update({(pynvml.NVML_FI_DEV_POWER_INSTANT, 0): 5_000_001}), "power_watts", "power_watts"),
        (
            lambda g: setattr(g, "clocks_mhz", {pynvml.NVML_CLOCK_SM: 5001, pynvml.NVML_CLOCK_MEM: 2619}),
            "sm_clock_hertz",
            "sm_clock_hertz",
        ),
        (
            lambda g: g.fields.update({(pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0): -5}),
            "pcie_rx_bytes_total",
            "pcie_rx_bytes_total",
        ),
        (
            lambda g: g.fields.update({(pynvml.NVML_FI_DEV_MEMORY_TEMP, 0): math.nan}),
            "memory_temperature_celsius",
            "memory_temperature_celsius",
        ),
        (
            lambda g: g.fields.update({(pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0): math.inf}),
            "energy_joules_total",
            "energy_joules_total",
        ),
        (lambda g: g.gpm_values.update({pynvml.NVML_GPM_METRIC_SM_UTIL: 100.5}), "sm_active_ratio", "sm_active_ratio"),
        (
            lambda g: g.fields.update({(pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST, 0): -1}),
            None,
            "throttle_seconds_total",
        ),
    ],
)
def test_nonsense_values_are_dropped_and_counted(two_gpus, mutate, field, reading):
    fake, reader = two_gpus
    reader.read()
    mutate(fake.gpus[0])
    gpu0, gpu1 = reader.read()
    if field is None:
        assert "sync_boost" not in gpu0.throttle_seconds_total and "sw_power_cap" in gpu0.throttle_seconds_total
    else:
        assert getattr(gpu0, field) is None and getattr(gpu1, field) is not None
    assert reader.errors[(reading, "invalid_value")] == 1
    assert reader.capabilities[0][field or "throttle_seconds_total.sync_boost"] is True


def test_negative_temperature_within_limits_is_kept(two_gpus):
    fake, reader = two_gpus
    fake.gpus[0].temperature = -5
    assert reader.read()[0].temperature_celsius == -5.0


def test_static_limits_probed_once(two_gpus):
    fake, reader = two_gpus
    for _ in range(3):
        reader.read()
    assert fake.called("nvmlDeviceGetTemperatureThreshold", 0) == 4
    assert fake.called("nvmlDeviceGetMaxClockInfo", 0) == 2
    assert fake.called("nvmlDeviceGetUUID", 0) == 1


@pytest.mark.parametrize("error", ["timeout", "unknown", "no_permission"])
def test_static_limit_failing_transiently_at_open_is_read_on_the_next_poll(error):
    fake = FakeNvml([h100(0)])
    fake.inject("nvmlDeviceGetTemperatureThreshold", ERRORS[error], index=0, times=1)  # slowdown, asked first
    fake.inject("nvmlDeviceGetMaxClockInfo", ERRORS[error], index=0, times=1)  # SM, asked first
    reader = opened(fake)
    first, second = reader.read()[0], reader.read()[0]
    assert reader.capabilities[0]["slowdown_temperature_celsius"] is True
    reader.close()
    assert first.slowdown_temperature_celsius == 87.0 and first.sm_clock_max_hertz == 1.98e9
    assert second.slowdown_temperature_celsius == 87.0
    assert reader.errors[("slowdown_temperature_celsius", error)] == 1
    assert fake.called("nvmlDeviceGetTemperatureThreshold", 0) == 5  # 4 at open, 1 retry, then never again


def test_static_limit_unsupported_at_open_is_not_asked_again():
    fake = FakeNvml([h100(0)])
    fake.inject("nvmlDeviceGetTemperatureThreshold", ERRORS["not_supported"], index=0, times=1)
    reader = opened(fake)
    gpu = [reader.read()[0] for _ in range(2)][-1]
    reader.close()
    assert gpu.slowdown_temperature_celsius is None and gpu.shutdown_temperature_celsius == 92.0
    assert fake.called("nvmlDeviceGetTemperatureThreshold", 0) == 4


def test_compute_pids():
    fake = FakeNvml([FakeGpu(uuid="GPU-a", pids=(4242, 4343), fields={})])
    reader = opened(fake)
    assert reader.compute_pids(0) == (4242, 4343)
    assert reader.compute_pids(7) == ()
    fake.inject("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_NO_PERMISSION, index=0, times=1)
    assert reader.compute_pids(0) == ()
    assert reader.errors[("compute_processes", "no_permission")] == 1
    fake.inject("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_GPU_IS_LOST, index=0, times=1)
    assert reader.compute_pids(0) == ()
    assert not reader.read()[0].up
    reader.close()
    assert reader.compute_pids(0) == ()


def test_close_is_idempotent_and_shuts_down():
    fake = FakeNvml([h100(0)])
    reader = opened(fake)
    reader.read()
    reader.close()
    reader.close()
    assert fake.called("nvmlShutdown") == 1 and not fake.initialized
    with pytest.raises(NvmlUnavailable):
        reader.read()


def test_rejects_bad_xid_wait():
    with pytest.raises(ValueError, match="xid_wait_ms"):
        NvmlReader(FakeNvml(), xid_wait_ms=0)


def test_non_nvml_exception_is_contained(two_gpus):
    fake, reader = two_gpus

    def broken(handle):
        raise RuntimeError("driver returned garbage")

    fake.nvmlDeviceGetUtilizationRates = broken
    gpu0, gpu1 = reader.read()
    assert gpu0.up and gpu0.utilization_ratio is None and gpu0.power_watts == 655.0
    assert reader.errors[("utilization_ratio", "other")] == 2


def test_the_readings_dcgm_exporter_also_serves_are_converted_exactly():
    gpu = h100(0, links=2)
    gpu.gpm_values.update(
        {
            pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 99.0,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 88.28,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 22.0,
            pynvml.NVML_GPM_METRIC_FP32_UTIL: 2.0,
            pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 5.0,
            pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 1024.0,
        }
    )
    gpu.fields[(pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, 0)] = 12
    reader = opened(FakeNvml([gpu]))
    reader.read()
    (sample,) = reader.read()
    reader.close()
    assert (sample.fan_speed_ratio, sample.performance_state) == (0.55, 0)
    assert (sample.encoder_utilization_ratio, sample.decoder_utilization_ratio) == (0.03, 0.07)
    assert (sample.power_management_limit_watts, sample.pcie_replays_total) == (650.0, 4)
    assert (sample.nvlink_replay_errors_total, sample.nvlink_crc_flit_errors_total) == (12, 1)
    assert (sample.graphics_active_ratio, sample.tensor_active_ratio) == (0.99, 0.8828)
    assert (sample.dram_active_ratio, sample.fp32_active_ratio, sample.fp64_active_ratio) == (0.22, 0.02, 0.0)
    assert sample.pcie_tx_bytes_per_second == 5 * 2**20 and sample.nvlink_rx_bytes_per_second == 2**30
    assert no_other_errors(reader)


def test_a_card_without_nvlink_or_fan_lacks_those_readings_rather_than_reading_zero():
    gpu = h100(0, links=0)
    gpu.fan_percent = None
    fake = FakeNvml([gpu])
    reader = opened(fake)
    reader.read()
    (sample,) = reader.read()
    calls = fake.called("nvmlDeviceGetFanSpeed")
    reader.read()
    lacking = ("fan_speed_ratio", "nvlink_crc_flit_errors_total", "nvlink_recovery_errors_total")
    lacking += ("nvlink_tx_bytes_per_second", "nvlink_rx_bytes_per_second")
    assert not any(reader.capabilities[0][name] for name in lacking)
    reader.close()
    assert all(getattr(sample, name) is None for name in lacking)
    assert sample.pcie_tx_bytes_per_second == 0.0 and sample.tensor_active_ratio == 0.0
    assert fake.called("nvmlDeviceGetFanSpeed") == calls == 1  # the probe, never a poll
