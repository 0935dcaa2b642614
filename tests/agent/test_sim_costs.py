"""The simulator's cost model: each call burns the real driver's thread CPU, counted apart per thread."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest

from gpufleet.agent.nvml_meter import MeteredNvml
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.sim.costs import CALL_COST_US, FIELD_COST_US, CostedNvml

EPOCH = 1_763_800_000.0


def sim() -> SimNvml:
    scenario = load_scenario("hgx-h100")
    nvml = SimNvml(scenario, node=scenario.nodes[0], clock=lambda: EPOCH + 60.0, epoch=EPOCH)
    nvml.nvmlInit()
    return nvml


def test_table_holds_the_h100_driver_580_figures():
    assert CALL_COST_US["nvmlDeviceGetTotalEnergyConsumption"] == 2845.0
    assert CALL_COST_US["nvmlGpmSampleGet"] == 236.9
    assert FIELD_COST_US["NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 3194.0
    assert FIELD_COST_US["NVML_FI_DEV_POWER_INSTANT"] == 3.0


def test_a_call_burns_at_least_its_cost_in_thread_cpu():
    costed = CostedNvml(sim(), call_cost_us={"nvmlDeviceGetEnforcedPowerLimit": 3000.0})
    handle = costed.nvmlDeviceGetHandleByIndex(0)
    burned = costed.burned_by_this_thread()
    started = time.thread_time_ns()
    assert costed.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000
    assert time.thread_time_ns() - started >= 3_000_000
    # The simulator's own work counts towards the cost: only the rest is burned.
    assert 0 < costed.burned_by_this_thread() - burned <= 0.003


def test_a_field_batch_costs_the_sum_of_its_fields():
    costed = CostedNvml(sim())
    power, energy = pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
    cost = costed.call_cost("nvmlDeviceGetFieldValues", (None, [(power, 0), (energy, 0)]))
    assert abs(cost - 3197e-6) < 1e-12
    assert costed.call_cost("nvmlDeviceGetUnheardOf", ()) == 40e-6


def test_burned_time_is_kept_per_thread():
    costed = CostedNvml(sim(), call_cost_us={"nvmlDeviceGetCount": 500.0})
    worker = threading.Thread(target=costed.nvmlDeviceGetCount)
    worker.start()
    worker.join()
    assert costed.burned_by_this_thread() == 0.0 and sum(costed.burned.values()) > 0


def test_constants_structures_and_helpers_pass_through():
    inner = sim()
    costed = CostedNvml(inner)
    assert costed.NVML_FI_DEV_POWER_INSTANT == pynvml.NVML_FI_DEV_POWER_INSTANT
    assert costed.c_nvmlGpmMetricsGet_t is pynvml.c_nvmlGpmMetricsGet_t
    assert costed.scenario_time() == inner.scenario_time()


def test_the_agents_meter_sees_the_burned_cost():
    metered = MeteredNvml(CostedNvml(sim(), call_cost_us={"nvmlDeviceGetCount": 2000.0}))
    assert metered.nvmlDeviceGetCount() == 8
    assert metered.seconds["nvmlDeviceGetCount"] >= 0.002


def test_the_new_calls_cost_what_an_h200_measured_and_gpm_costs_by_its_metrics():
    assert CALL_COST_US["nvmlDeviceGetPcieReplayCounter"] == 174.2
    assert CALL_COST_US["nvmlDeviceGetFanSpeed"] == 162.0
    assert FIELD_COST_US["NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"] == 5.7
    nvml = CostedNvml(sim())

    def request(*metrics: int) -> pynvml.c_nvmlGpmMetricsGet_t:
        out = pynvml.c_nvmlGpmMetricsGet_t()
        out.numMetrics = len(metrics)
        for i, metric in enumerate(metrics):
            out.metrics[i].metricId = metric
        return out

    shared = request(pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY)
    assert nvml.call_cost("nvmlGpmMetricsGet", (shared,)) * 1e6 == pytest.approx(13.4)  # the H100's measured call
    graphics = nvml.call_cost("nvmlGpmMetricsGet", (request(pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL),))
    assert 1.2e-3 <= graphics <= 1.5e-3


class _Slow:
    """An NVML stand-in whose one call does 2 ms of the simulator's own work."""

    def nvmlDeviceGetCount(self) -> int:
        burn_for(0.002)
        return 1


def burn_for(seconds: float) -> None:
    end = time.thread_time_ns() + int(seconds * 1e9)
    while time.thread_time_ns() < end:
        pass


def test_the_agents_probe_clock_leaves_out_the_simulators_own_work():
    costed = CostedNvml(_Slow(), call_cost_us={"nvmlDeviceGetCount": 10.0})
    raw, probed = time.thread_time_ns(), costed.thread_time_ns()
    assert costed.nvmlDeviceGetCount() == 1
    assert time.thread_time_ns() - raw >= 2_000_000
    # What the real call costs (10 us) and the wrapper's few microseconds, not the 2 ms of simulator work.
    assert costed.thread_time_ns() - probed < 1_000_000
    other = threading.Thread(target=costed.nvmlDeviceGetCount)
    other.start()
    other.join()
    assert costed.excess >= 2 * 0.00199  # both threads' excess counted, each on its own thread's clock
    assert costed.thread_time_ns() - probed < 1_000_000
