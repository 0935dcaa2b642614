"""SimNvml: pynvml's surface, types, units and errors, driven by a fake clock."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time

import pynvml
import pytest

from gpufleet.agent.sim import SimNvml, load_scenario, parse_scenario

UINT_MAX = 0xFFFFFFFF


class FakeClock:
    """A settable clock; scenario epoch 1_700_000_000."""

    epoch = 1_700_000_000.0

    def __init__(self, t: float = 0.0):
        self.now = self.epoch + t

    def __call__(self) -> float:
        return self.now

    def at(self, t: float) -> "FakeClock":
        self.now = self.epoch + t
        return self


def _sim(scenario: str, node: str, t: float = 0.0, seed: int = 0) -> tuple[SimNvml, FakeClock]:
    clock = FakeClock(t)
    nvml = SimNvml(load_scenario(scenario), node=node, clock=clock, epoch=FakeClock.epoch, seed=seed)
    nvml.nvmlInit()
    return nvml, clock


def _sm_activity(nvml: SimNvml, clock: FakeClock, index: int, t0: float, t1: float) -> float:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    s1, s2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    clock.at(t0)
    nvml.nvmlGpmSampleGet(handle, s1)
    clock.at(t1)
    nvml.nvmlGpmSampleGet(handle, s2)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = 2
    mg.sample1, mg.sample2 = s1, s2
    mg.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    mg.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    assert nvml.nvmlGpmMetricsGet(mg) is mg
    assert mg.metrics[0].nvmlReturn == mg.metrics[1].nvmlReturn == pynvml.NVML_SUCCESS
    assert 0 < mg.metrics[1].value < mg.metrics[0].value
    nvml.nvmlGpmSampleFree(s1)
    nvml.nvmlGpmSampleFree(s2)
    return mg.metrics[0].value


def _fields(nvml: SimNvml, index: int, fields: list) -> list:
    return list(nvml.nvmlDeviceGetFieldValues(nvml.nvmlDeviceGetHandleByIndex(index), fields))


def _power_w(nvml: SimNvml, index: int) -> float:
    return _fields(nvml, index, [pynvml.NVML_FI_DEV_POWER_INSTANT])[0].value.uiVal / 1000


# --- library and identity ------------------------------------------------------------------------


def test_constants_structs_and_errors_are_exposed():
    nvml, _ = _sim("hgx-h100", "hgx-h100-01")
    assert nvml.NVML_FI_DEV_MEMORY_TEMP == pynvml.NVML_FI_DEV_MEMORY_TEMP
    assert nvml.nvmlEventTypeXidCriticalError == pynvml.nvmlEventTypeXidCriticalError
    assert nvml.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert nvml.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert nvml.c_nvmlGpmMetricsGet_t is pynvml.c_nvmlGpmMetricsGet_t
    assert callable(nvml.nvmlInit)  # constants never shadow the methods


def test_calls_before_init_and_after_shutdown_raise_uninitialized():
    clock = FakeClock()
    nvml = SimNvml(load_scenario("hgx-h100"), node="hgx-h100-01", clock=clock, epoch=clock.epoch)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 8  # init is reference counted, as in NVML
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetName(handle)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_system_and_identity():
    nvml, _ = _sim("hgx-h100", "hgx-h100-01", t=10)
    assert nvml.nvmlSystemGetDriverVersion() == "550.90.07"
    assert nvml.nvmlSystemGetNVMLVersion().startswith("12.")
    assert nvml.nvmlSystemGetCudaDriverVersion() == 12040
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    assert all(isinstance(h, pynvml.c_nvmlDevice_t) for h in handles)
    uuids = {nvml.nvmlDeviceGetUUID(h) for h in handles}
    assert len(uuids) == 8 and all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
    assert nvml.nvmlDeviceGetName(handles[0]) == "NVIDIA H100 80GB HBM3"
    pci = nvml.nvmlDeviceGetPciInfo_v3(handles[0])
    assert isinstance(pci, pynvml.nvmlPciInfo_t) and pci.busId == "00000000:18:00.0"  # pynvml decodes char arrays
    assert nvml.nvmlDeviceGetSerial(handles[1]).isdigit()
    assert nvml.nvmlDeviceGetVbiosVersion(handles[0]).count(".") == 4
    assert nvml.nvmlDeviceGetArchitecture(handles[0]) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert nvml.nvmlDeviceGetTemperatureThreshold(handles[0], pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN) == 89
    assert nvml.nvmlDeviceGetTemperatureThreshold(handles[0], pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN) == 95
    assert nvml.nvmlDeviceGetMaxClockInfo(handles[0], pynvml.NVML_CLOCK_SM) == 1980
    assert nvml.nvmlGpmQueryDeviceSupport(handles[0]).isSupportedDevice == 1
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(8)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(object())


def test_same_inputs_same_readings_regardless_of_history():
    a, ca = _sim("demo", "dgx-02", seed=3)
    b, cb = _sim("demo", "dgx-02", seed=3)
    for t in (30.0, 90.0, 200.0, 250.5):  # b is polled every second on the way; a jumps
        ca.at(t)
        read_a = _fields(a, 5, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, pynvml.NVML_FI_DEV_POWER_INSTANT])
        for s in range(int(t) - 20, int(t)):
            cb.at(s)
            b.nvmlDeviceGetUtilizationRates(b.nvmlDeviceGetHandleByIndex(5))
        cb.at(t)
        read_b = _fields(b, 5, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, pynvml.NVML_FI_DEV_POWER_INSTANT])
        assert [v.value.ullVal for v in read_a] == [v.value.ullVal for v in read_b]
        assert a.nvmlDeviceGetTemperatureV(a.nvmlDeviceGetHandleByIndex(5), 0) == b.nvmlDeviceGetTemperatureV(
            b.nvmlDeviceGetHandleByIndex(5), 0
        )


def test_agents_for_different_nodes_agree_on_a_remote_straggler():
    """dgx-02 GPU 5 overheats; dgx-01's peers in job 71001 wait for it although no agent talks to another."""
    n1, c1 = _sim("demo", "dgx-01")
    n2, c2 = _sim("demo", "dgx-02")
    hot = n2.nvmlDeviceGetHandleByIndex(5)
    c2.at(300)
    assert n2.nvmlDeviceGetTemperatureV(hot, pynvml.NVML_TEMPERATURE_GPU) > 83
    throttled = 0
    for t in range(280, 340):
        c2.at(t)
        throttled |= n2.nvmlDeviceGetCurrentClocksEventReasons(hot)
    assert throttled & pynvml.nvmlClocksEventReasonHwThermalSlowdown
    sm_before = _sm_activity(n1, c1, 3, 90, 115)
    power_before = _power_w(n1, 3)
    sm_during = _sm_activity(n1, c1, 3, 280, 350)
    power_during = statistics_mean(_power_at(n1, c1, 3, t) for t in range(280, 350, 3))
    assert sm_during < 0.85 * sm_before
    assert power_during < 0.9 * power_before
    c1.at(330)
    assert n1.nvmlDeviceGetUtilizationRates(n1.nvmlDeviceGetHandleByIndex(3)).gpu >= 98
    # dgx-02's own healthy GPUs see the same job-wide wait as dgx-01's.
    assert _sm_activity(n2, c2, 0, 280, 350) == pytest.approx(sm_during, rel=0.05)
    assert _sm_activity(n2, c2, 5, 280, 350) > 1.3 * sm_during


def _power_at(nvml: SimNvml, clock: FakeClock, index: int, t: float) -> float:
    clock.at(t)
    return _power_w(nvml, index)


def statistics_mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# --- readings and units --------------------------------------------------------------------------


def test_memory_info_v1_and_v2():
    nvml, _ = _sim("hgx-h100", "hgx-h100-01", t=200)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    assert v2.total == 81559 * 1024**2
    assert v2.used + v2.free + v2.reserved == v2.total
    assert 62 * 1024**3 * 0.97 < v2.used < 62 * 1024**3 * 1.03
    v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
    assert isinstance(v1, pynvml.c_nvmlMemory_t) and v1.used == v2.used + v2.reserved
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(handle, version=1)


def test_busy_gpu_readings():
    nvml, clock = _sim("hgx-h100", "hgx-h100-01", t=300)
    handle = nvml.nvmlDeviceGetHandleByIndex(2)
    util = nvml.nvmlDeviceGetUtilizationRates(handle)
    assert isinstance(util, pynvml.c_nvmlUtilization_t) and util.gpu >= 98 and 0 < util.memory < 100
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) == 1980
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM) == 2619
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == 0
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000
    assert 450 < _power_w(nvml, 2) < 700
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert len(procs) == 1 and procs[0].pid > 1 and procs[0].usedGpuMemory > 60 * 1024**3
    assert procs[0].gpuInstanceId == UINT_MAX


def test_idle_gpu_has_idle_bit_and_no_processes():
    nvml, _ = _sim("cluster-incidents", "node-c", t=400)
    handle = nvml.nvmlDeviceGetHandleByIndex(6)
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(handle) & pynvml.nvmlClocksEventReasonGpuIdle
    assert nvml.nvmlDeviceGetComputeRunningProcesses(handle) == []
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 0


def test_field_values_types_units_and_counters():
    nvml, clock = _sim("hgx-h100", "hgx-h100-01", t=200)
    ids = [
        pynvml.NVML_FI_DEV_POWER_INSTANT,
        pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
        pynvml.NVML_FI_DEV_MEMORY_TEMP,
        pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
        pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX),
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
    ]
    first = _fields(nvml, 0, ids)
    assert all(v.nvmlReturn == pynvml.NVML_SUCCESS for v in first)
    assert [v.fieldId for v in first[:5]] == ids[:5] and first[5].scopeId == UINT_MAX
    assert first[0].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert first[1].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert first[7].value.uiVal == 18
    assert first[0].timestamp == int(clock() * 1e6)
    clock.at(210)
    second = _fields(nvml, 0, ids)
    energy_j = (second[1].value.ullVal - first[1].value.ullVal) / 1000
    assert 10 * 400 < energy_j < 10 * 700
    nvlink_kib = second[5].value.ullVal - first[5].value.ullVal
    assert 1e6 < nvlink_kib / 10 < 18 * 25e9 / 1024  # KiB/s, below the links' capacity
    assert second[4].value.ullVal > first[4].value.ullVal
    hbm = second[2].value.uiVal
    gpu = nvml.nvmlDeviceGetTemperatureV(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_TEMPERATURE_GPU)
    assert gpu < hbm < gpu + 15


def test_per_link_nvlink_sums_to_total_and_bad_link_is_per_entry():
    nvml, _ = _sim("hgx-h100", "hgx-h100-01", t=300)
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    values = _fields(nvml, 1, [(tx, UINT_MAX)] + [(tx, link) for link in range(19)])
    links = [v.value.ullVal for v in values[1:19]]
    assert sum(links) == pytest.approx(values[0].value.ullVal, rel=1e-6)
    assert len(set(links)) > 1
    assert values[19].nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_mixed_per_entry_return_codes():
    nvml, _ = _sim("pcie", "pcie-01", t=200)
    values = _fields(
        nvml,
        0,
        [
            pynvml.NVML_FI_DEV_POWER_INSTANT,
            pynvml.NVML_FI_DEV_MEMORY_TEMP,
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX),
            pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
            pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            pynvml.NVML_FI_DEV_ECC_CURRENT,
        ],
    )
    assert [v.nvmlReturn for v in values] == [
        pynvml.NVML_SUCCESS,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_SUCCESS,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
    ]
    assert values[4].value.ullVal > 0  # the PCIe card's collectives travel over PCIe


@pytest.mark.parametrize(("scenario", "node"), [("a100", "a100-01"), ("pcie", "pcie-01")])
def test_gpm_unsupported_models(scenario, node):
    nvml, _ = _sim(scenario, node, t=100)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == 0
    sample = nvml.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlGpmSampleGet(handle, sample)
    nvml.nvmlGpmSampleFree(sample)


def test_a100_identity_and_support():
    nvml, _ = _sim("a100", "a100-01", t=100)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetArchitecture(handle) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert nvml.nvmlDeviceGetName(handle) == "NVIDIA A100-SXM4-80GB"
    assert _fields(nvml, 0, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0].value.uiVal == 12
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 0)


def test_pcie_card_unsupported_paths():
    nvml, _ = _sim("pcie", "pcie-01", t=100)
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetTemperatureThreshold(handle, pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetRemappedRows(handle)
    assert nvml.nvmlDeviceGetArchitecture(handle) == pynvml.NVML_DEVICE_ARCH_ADA
    assert (
        nvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC) == 0
    )


def test_gpm_argument_errors():
    nvml, clock = _sim("hgx-h100", "hgx-h100-01", t=100)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version = 99
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlGpmMetricsGet(mg)
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = 1
    mg.sample1, mg.sample2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # samples never filled
        nvml.nvmlGpmMetricsGet(mg)
    nvml.nvmlGpmSampleFree(mg.sample1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpmSampleFree(mg.sample1)


def test_gpm_unknown_metric_is_per_metric_not_supported():
    nvml, clock = _sim("hgx-h100", "hgx-h100-01", t=100)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    s1, s2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(handle, s1)
    clock.at(101)
    nvml.nvmlGpmSampleGet(handle, s2)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics, mg.sample1, mg.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 2, s1, s2
    mg.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    mg.metrics[1].metricId = pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL
    nvml.nvmlGpmMetricsGet(mg)
    assert mg.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS and mg.metrics[0].value > 50
    assert mg.metrics[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


# --- incidents -----------------------------------------------------------------------------------


def test_gpu_lost_only_for_that_gpu_from_its_start():
    nvml, clock = _sim("cluster-incidents", "node-a", t=740)
    lost = nvml.nvmlDeviceGetHandleByIndex(7)
    assert nvml.nvmlDeviceGetUUID(lost)
    clock.at(751)
    for call in (
        nvml.nvmlDeviceGetUUID,
        nvml.nvmlDeviceGetUtilizationRates,
        nvml.nvmlDeviceGetCurrentClocksEventReasons,
        nvml.nvmlDeviceGetComputeRunningProcesses,
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(lost)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetFieldValues(lost, [pynvml.NVML_FI_DEV_POWER_INSTANT])
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(7)
    assert nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByIndex(6)).gpu >= 98
    clock.at(5000)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetName(lost)


def test_xid_delivered_in_order_exactly_once():
    nvml, clock = _sim("cluster-incidents", "node-a", t=100)
    es = nvml.nvmlEventSetCreate()
    for i in range(8):
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(i), pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(es, 500)
    clock.at(400)
    got = []
    while True:
        try:
            data = nvml.nvmlEventSetWait_v2(es, 0)
        except pynvml.NVMLError_Timeout:
            break
        assert isinstance(data, pynvml.c_nvmlEventData_t)
        assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
        index = [ctypes.cast(nvml.nvmlDeviceGetHandleByIndex(i), ctypes.c_void_p).value for i in range(8)].index(
            ctypes.cast(data.device, ctypes.c_void_p).value
        )
        got.append((index, data.eventData))
    # Burst of three XID 79 on GPU 6 over 120-130 s, one XID 13 on GPU 2 at 125 s, in time order.
    assert got == [(6, 79), (6, 79), (2, 13), (6, 79)]
    clock.at(800)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(es, 100)
    nvml.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlEventSetWait_v2(es, 100)


def test_xid_only_for_registered_gpus_and_after_registration():
    nvml, clock = _sim("cluster-incidents", "node-a", t=124)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(6), pynvml.nvmlEventTypeXidCriticalError, es)
    clock.at(200)
    codes = []
    with pytest.raises(pynvml.NVMLError_Timeout):
        while True:
            codes.append(nvml.nvmlEventSetWait_v2(es, 0).eventData)
    assert codes == [79]  # the event at 120 s happened before registration; GPU 2 is not registered


def test_counter_reset_restarts_counters():
    nvml, clock = _sim("cluster-incidents", "node-a", t=699)
    ids = [
        pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX),
        pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP,
    ]
    before = [v.value.ullVal for v in _fields(nvml, 0, ids)]
    assert before[3] == pytest.approx(100e9, rel=0.02)  # ~100 s under the power cap, in ns
    clock.at(702)
    after = [v.value.ullVal for v in _fields(nvml, 0, ids)]
    assert all(0 <= a < b / 10 for a, b in zip(after[:3], before[:3]))
    assert after[3] == 0
    assert 2 * 400_000 < after[0] < 2 * 700_000  # 2 s of energy in mJ


def test_nvml_init_failure_window():
    clock = FakeClock(5)
    nvml = SimNvml(load_scenario("cluster-incidents"), node="node-c", clock=clock, epoch=clock.epoch)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml.nvmlInit()
    clock.at(21)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 8
    other = SimNvml(load_scenario("cluster-incidents"), node="node-a", clock=FakeClock(5), epoch=clock.epoch)
    other.nvmlInit()


def test_power_cap_lowers_enforced_limit():
    nvml, clock = _sim("cluster-incidents", "node-b", t=600)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(handle) == 450_000
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(handle) & pynvml.nvmlClocksEventReasonSwPowerCap
    clock.at(660)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000


def test_full_load_reads_power_capped_at_the_enforced_limit():
    """A load wanting more than the board's limit, and an operator cap above that limit: the enforced limit
    stays the board's, and the power the governor holds the GPU at sits under it with SW_POWER_CAP."""
    scenario = parse_scenario(
        {
            "name": "burn",
            "duration_s": 300,
            "nodes": [{"name": "n", "model": "h100-sxm", "gpus": 1}],
            "jobs": [{"id": "j", "nodes": ["n"], "ramp_up_s": 0, "compute_fraction": 0.99, "compute_intensity": 1.43}],
            "incidents": [{"kind": "power_cap", "node": "n", "start_s": 0, "watts": 900}],
        }
    )
    clock = FakeClock(120)
    nvml = SimNvml(scenario, node="n", clock=clock, epoch=clock.epoch)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    limit_mw = nvml.nvmlDeviceGetEnforcedPowerLimit(handle)
    assert limit_mw == 700_000
    assert 0.95 * limit_mw <= nvml.nvmlDeviceGetPowerUsage(handle) <= limit_mw
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == pynvml.nvmlClocksEventReasonSwPowerCap
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) < 1700


def test_ecc_and_remapped_rows():
    nvml, clock = _sim("cluster-incidents", "node-a", t=130)
    handle = nvml.nvmlDeviceGetHandleByIndex(6)
    ecc = nvml.nvmlDeviceGetTotalEccErrors
    assert ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC) == 40
    assert ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC) == 2
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (0, 2, 1, 0)
    clock.at(705)  # driver reload: volatile counts restart, aggregate ones stay
    assert ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC) == 0
    assert ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC) == 40
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (0, 2, 0, 0)


# --- processes -----------------------------------------------------------------------------------


def test_materialize_procfs(tmp_path):
    nvml, _ = _sim("demo", "dgx-02", t=200)
    pids = nvml.materialize_procfs(tmp_path)
    assert len(pids) == 8 and len(set(pids)) == 8
    for index in range(8):
        (proc,) = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(index))
        assert proc.pid in pids
        environ = (tmp_path / str(proc.pid) / "environ").read_bytes()
        assert environ.endswith(b"\0")
        assert b"SLURM_JOB_ID=71001" in environ.split(b"\0")
        cgroup = (tmp_path / str(proc.pid) / "cgroup").read_text()
        assert cgroup == "0::/system.slice/slurmstepd.scope/job_71001/step_0/user/task_0\n"


def test_materialize_procfs_of_a_kubernetes_job(tmp_path):
    scenario = parse_scenario(
        {
            "nodes": [{"name": "n1", "model": "h100-sxm", "gpus": 2}, {"name": "n2", "model": "h100-sxm", "gpus": 2}],
            "jobs": [{"id": "research/llama", "nodes": ["n1", "n2"], "scheduler": "kubernetes"}],
        }
    )
    nvml = SimNvml(scenario, "n2", clock=lambda: 1000.0, epoch=0.0)
    pids = nvml.materialize_procfs(tmp_path)
    assert len(pids) == 2
    for pid in pids:
        environ = dict(e.split(b"=", 1) for e in (tmp_path / str(pid) / "environ").read_bytes().split(b"\0") if e)
        assert environ[b"GPUFLEET_JOB"] == b"research/llama" and environ[b"HOSTNAME"] == b"llama-worker-1"
        assert b"SLURM_JOB_ID" not in environ and environ[b"RANK"] in (b"2", b"3")
        cgroup = (tmp_path / str(pid) / "cgroup").read_text()
        assert cgroup.startswith("0::/kubepods.slice/kubepods-pod") and "job_" not in cgroup


def test_pids_are_deterministic_across_agents():
    a, _ = _sim("demo", "dgx-03", t=100, seed=1)
    b, _ = _sim("demo", "dgx-03", t=100, seed=2)
    pid = lambda n: n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(2))[0].pid  # noqa: E731
    assert pid(a) == pid(b)


def test_blocking_wait_is_woken_by_shutdown():
    """With blocking enabled a waiter sleeps up to its timeout; nvmlShutdown releases it at once."""
    clock = FakeClock(0)
    nvml = SimNvml(load_scenario("hgx-h100"), node="hgx-h100-01", clock=clock, epoch=clock.epoch, block_on_events=True)
    nvml.nvmlInit()
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, es)
    outcome: list[type] = []

    def wait() -> None:
        try:
            nvml.nvmlEventSetWait_v2(es, 600_000)
        except pynvml.NVMLError as exc:
            outcome.append(type(exc))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    nvml.nvmlShutdown()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert outcome == [pynvml.NVMLError_Uninitialized]


class _WaiterClock(FakeClock):
    """FakeClock that counts the reads made off the main thread: the event waiter's."""

    def __init__(self, t: float = 0.0):
        super().__init__(t)
        self.waiter_reads = 0
        self.read_by_waiter = threading.Event()

    def __call__(self) -> float:
        if threading.current_thread() is not threading.main_thread():
            self.waiter_reads += 1
            self.read_by_waiter.set()
        return self.now


def _blocking_on_gpu6(clock: FakeClock, monotonic=time.monotonic) -> tuple[SimNvml, object]:
    """cluster-incidents' node-a, blocking waits, GPU 6 (XID 79 at 120, 123.3 and 126.7 s) registered."""
    nvml = SimNvml(
        load_scenario("cluster-incidents"),
        node="node-a",
        clock=clock,
        epoch=clock.epoch,
        block_on_events=True,
        monotonic=monotonic,
    )
    nvml.nvmlInit()
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(6), pynvml.nvmlEventTypeXidCriticalError, es)
    return nvml, es


def _waiting(nvml: SimNvml, es: object, timeoutms: int) -> tuple[threading.Thread, list]:
    """A thread inside nvmlEventSetWait_v2; what it returned or raised lands in the list."""
    outcome: list = []

    def wait() -> None:
        try:
            outcome.append(nvml.nvmlEventSetWait_v2(es, timeoutms))
        except pynvml.NVMLError as exc:
            outcome.append(type(exc))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    return waiter, outcome


def test_blocking_wait_sleeps_until_a_call_reads_the_clock_past_its_event():
    """Under an injected clock the waiter does not look for events in slices: calls before the event's time
    leave it asleep, and the first call that reads the clock past it wakes it with the event."""
    clock = _WaiterClock(100)
    nvml, es = _blocking_on_gpu6(clock)
    handle = nvml.nvmlDeviceGetHandleByIndex(6)
    waiter, outcome = _waiting(nvml, es, 600_000)
    assert clock.read_by_waiter.wait(10)
    nvml.nvmlEventSetCreate()  # takes the lock that the waiter holds until it sleeps
    reads = clock.waiter_reads
    for _ in range(50):
        nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    clock.at(119.9)
    nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    assert clock.waiter_reads == reads and not outcome  # not woken: nothing due yet
    clock.at(121)
    nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    (data,) = outcome
    assert data.eventData == 79
    assert ctypes.cast(data.device, ctypes.c_void_p).value == ctypes.cast(handle, ctypes.c_void_p).value
    with pytest.raises(pynvml.NVMLError_Timeout):  # delivered once
        nvml.nvmlEventSetWait_v2(es, 0)


def test_blocking_wait_times_out_after_its_timeout_leaving_later_events_due():
    """NVML_ERROR_TIMEOUT once timeoutms of (injected) monotonic time pass with nothing due; the event that
    falls due later is still delivered to the next wait."""
    clock = FakeClock(100)
    nvml, es = _blocking_on_gpu6(clock, monotonic=itertools.count(0.0, 2.0).__next__)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(es, 2000)
    clock.at(121)
    assert nvml.nvmlEventSetWait_v2(es, 2000).eventData == 79


def test_blocking_wait_is_woken_by_freeing_its_set():
    clock = _WaiterClock(100)
    nvml, es = _blocking_on_gpu6(clock)
    waiter, outcome = _waiting(nvml, es, 600_000)
    assert clock.read_by_waiter.wait(10)
    nvml.nvmlEventSetFree(es)
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert outcome == [pynvml.NVMLError_InvalidArgument]


# --- the readings dcgm-exporter also serves --------------------------------------------------------


def _link_errors_scenario(model: str = "h100-sxm") -> object:
    return parse_scenario(
        {
            "name": "retries",
            "duration_s": 300,
            "nodes": [{"name": "n", "model": model, "gpus": 2}],
            "jobs": [{"id": "j", "nodes": ["n"], "ramp_up_s": 0}],
            "incidents": [
                {"kind": "link_errors", "node": "n", "gpu": 1, "start_s": 100, "end_s": 110, "nvlink_replays": 50},
                {"kind": "link_errors", "node": "n", "gpu": 1, "start_s": 100, "end_s": 110, "pcie_replays": 20},
                {"kind": "counter_reset", "node": "n", "gpu": 1, "start_s": 200},
            ],
        }
    )


_NVLINK_ERRORS = [
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
]


def test_link_errors_raise_the_nvlink_error_and_pcie_replay_counters_of_their_gpu_only():
    clock = FakeClock(50)
    nvml = SimNvml(_link_errors_scenario(), node="n", clock=clock, epoch=clock.epoch)
    nvml.nvmlInit()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]

    def counts(index: int) -> tuple[list[int], int]:
        values = _fields(nvml, index, _NVLINK_ERRORS)
        assert all(v.nvmlReturn == pynvml.NVML_SUCCESS for v in values)
        return [v.value.ullVal for v in values], nvml.nvmlDeviceGetPcieReplayCounter(handles[index])

    assert counts(1) == ([0, 0, 0, 0], 0)
    clock.at(105)
    assert counts(1) == ([25, 0, 25, 0], 10)  # half way through the incident
    clock.at(150)
    assert counts(1) == ([50, 0, 50, 0], 20) and counts(0) == ([0, 0, 0, 0], 0)
    clock.at(201)  # a driver reload starts them from 0
    assert counts(1) == ([0, 0, 0, 0], 0)


def test_a_board_without_nvlink_has_no_nvlink_error_counters():
    nvml, _ = _sim("pcie", "pcie-01", t=100)
    assert all(v.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED for v in _fields(nvml, 0, _NVLINK_ERRORS))
    assert nvml.nvmlDeviceGetPcieReplayCounter(nvml.nvmlDeviceGetHandleByIndex(0)) == 0


def test_an_sxm_board_has_no_fan_and_the_other_new_calls_answer_as_a_real_h100():
    nvml, _ = _sim("hgx-h100", "hgx-h100-01", t=100)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetFanSpeed(handle)
    assert nvml.nvmlDeviceGetPerformanceState(handle) == pynvml.NVML_PSTATE_0
    assert nvml.nvmlDeviceGetEncoderUtilization(handle)[0] == nvml.nvmlDeviceGetDecoderUtilization(handle)[0] == 0
    assert nvml.nvmlDeviceGetPowerManagementLimit(handle) == 700_000
    assert nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved == 535 * 1024 * 1024


def test_gpm_profiling_metrics_follow_the_load():
    nvml, clock = _sim("hgx-h100", "hgx-h100-01", t=100)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    s1, s2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(handle, s1)
    clock.at(101)
    nvml.nvmlGpmSampleGet(handle, s2)
    wanted = {
        "sm": pynvml.NVML_GPM_METRIC_SM_UTIL,
        "graphics": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
        "tensor": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        "dram": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
        "fp64": pynvml.NVML_GPM_METRIC_FP64_UTIL,
        "fp32": pynvml.NVML_GPM_METRIC_FP32_UTIL,
        "fp16": pynvml.NVML_GPM_METRIC_FP16_UTIL,
        "pcie_rx": pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
        "nvlink_tx": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    }
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics, mg.sample1, mg.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, len(wanted), s1, s2
    for i, metric in enumerate(wanted.values()):
        mg.metrics[i].metricId = metric
    nvml.nvmlGpmMetricsGet(mg)
    assert all(mg.metrics[i].nvmlReturn == pynvml.NVML_SUCCESS for i in range(len(wanted)))
    got = {name: mg.metrics[i].value for i, name in enumerate(wanted)}
    # A training step: busy tensor cores under busy SMs, some FP32 and FP16 work beside them, no FP64;
    # gradients over NVLink (MiB/s) and input over PCIe.
    assert got["graphics"] > got["sm"] > got["tensor"] > got["fp32"] > got["fp16"] > got["fp64"] == 0
    assert 0 < got["dram"] < 100
    assert 100 < got["pcie_rx"] < 50e9 / 2**20 and 1000 < got["nvlink_tx"] < 18 * 25e9 / 2**20
