"""The reader's sampling tiers on a fake NVML whose calls cost what a test says (agent.sim.costs)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pynvml
import pytest

from gpufleet.agent.model import ThrottleReason
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.sim.costs import CostedNvml
from gpufleet.agent.tiers import DEFAULT_CPU_BUDGET, FAST_READINGS, INTEGRATED
from tests.agent.fake_nvml import FakeNvml, h100

ENERGY = (pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0)
HW_THERMAL = (pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, 0)
# Costly the way driver 580 is on an H100, scaled so that a 4 ms/s budget must slow them and leaves the rest every cycle.
CALLS_US = {"nvmlDeviceGetMemoryInfo": 2000.0}
FIELDS_US = {
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 4000.0,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 2000.0,
}


class Clock:
    def __init__(self) -> None:
        self.now = 1_763_800_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def costly():
    fake = FakeNvml([h100(0, links=0), h100(1, links=0)])
    clock = Clock()
    nvml = CostedNvml(fake, call_cost_us=CALLS_US, field_cost_us=FIELDS_US)
    reader = NvmlReader(nvml, xid_wait_ms=20, cpu_budget=0.004, interval_s=1.0, clock=clock)
    reader.open()
    yield fake, reader, clock
    reader.close()


def cycle(reader: NvmlReader, clock: Clock):
    clock.now += 1.0
    return reader.read()


def test_costly_reads_get_slower_periods_and_cheap_ones_stay_every_cycle(costly):
    _, reader, _ = costly
    periods = reader.plan.periods
    assert periods["energy_joules_total"] > 1 and periods["memory_used_bytes"] > 1
    assert periods["utilization_ratio"] == periods["power_watts"] == periods["throttle_reasons"] == 1
    assert reader.reading_periods["energy_joules_total"] == periods["energy_joules_total"] * 1.0


def test_a_slow_reading_keeps_its_last_value_and_says_how_old_it_is(costly):
    fake, reader, clock = costly
    period = reader.plan.periods["energy_joules_total"]
    first = fake.gpus[0].fields[ENERGY]
    ages, energies = [], []
    for n in range(2 * period):
        fake.gpus[0].fields[ENERGY] = first + 1000 * (n + 1)
        gpu = cycle(reader, clock)[0]
        ages.append(gpu.slow_readings_age_seconds.get("energy_joules_total", 0.0))
        energies.append(gpu.energy_joules_total)
        assert gpu.power_watts == 655.0 and "power_watts" not in gpu.slow_readings_age_seconds
    assert max(ages) == period - 1 and ages.count(0.0) == 2
    assert all(e is not None for e in energies) and energies == sorted(energies)  # a counter stays a counter
    assert len(set(energies)) == 3  # the probe's value, then two reads


def test_the_field_batch_asks_only_for_what_is_due(costly):
    fake, reader, clock = costly
    fake.field_requests.clear()
    for _ in range(reader.plan.periods["energy_joules_total"]):
        cycle(reader, clock)
    asked = [request for index, request in fake.field_requests if index == 0]
    assert sum(ENERGY in request for request in asked) == 1
    assert all((pynvml.NVML_FI_DEV_POWER_INSTANT, 0) in request for request in asked)


def test_a_costly_throttle_counter_is_integrated_from_the_reasons_mask(costly):
    fake, reader, clock = costly
    assert reader.plan.periods["throttle_seconds_total.hw_thermal_slowdown"] == 0
    fake.field_requests.clear()
    fake.gpus[0].reasons = int(ThrottleReason.HW_THERMAL_SLOWDOWN)
    totals = [cycle(reader, clock)[0].throttle_seconds_total["hw_thermal_slowdown"] for _ in range(4)]
    fake.gpus[0].reasons = 0
    after = cycle(reader, clock)[0].throttle_seconds_total["hw_thermal_slowdown"]
    # The first read after open has no earlier mask to measure time from; then bit x interval.
    assert totals == [0.0, 1.0, 2.0, 3.0] and after == 3.0
    assert not any(HW_THERMAL in request for _, request in fake.field_requests)
    # The cheap counters still come from the driver.
    assert cycle(reader, clock)[0].throttle_seconds_total["sw_power_cap"] == 1.5


def test_a_failed_slow_read_is_absent_not_stale(costly):
    fake, reader, clock = costly
    period = reader.plan.periods["memory_used_bytes"]
    fake.inject("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_UNKNOWN, index=0)
    seen = [cycle(reader, clock)[0].memory_used_bytes for _ in range(2 * period)]
    assert seen[-1] is None and seen[0] is not None


def test_the_nvml_cost_counter_names_each_function_and_the_costly_field_ids(costly):
    _, reader, clock = costly
    for _ in range(reader.plan.periods["energy_joules_total"]):  # each GPU reads energy once
        cycle(reader, clock)
    spent = reader.nvml_seconds
    assert spent["nvmlDeviceGetMemoryInfo"] >= 2 * 0.002  # probed on both GPUs at open
    assert {"nvmlDeviceGetFieldValues", "nvmlDeviceGetUtilizationRates"} <= set(spent)
    # The batch's time goes to its fields by their probed cost: energy's two reads, 4 ms each.
    assert spent["nvmlDeviceGetFieldValues/energy_joules_total"] >= 0.0075
    assert spent["nvmlDeviceGetFieldValues/power_watts"] < 0.002


def test_an_unreachable_budget_is_logged_and_ages_stay_bounded(caplog):
    fake = FakeNvml([h100(0, links=0)])
    clock = Clock()
    nvml = CostedNvml(fake, call_cost_us={"nvmlDeviceGetUtilizationRates": 3000.0, **CALLS_US}, field_cost_us=FIELDS_US)
    reader = NvmlReader(nvml, xid_wait_ms=20, cpu_budget=0.0001, interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="gpufleet.agent.nvml_reader"):
        reader.open()
    try:
        assert any("exceed the cpu budget" in r.getMessage() for r in caplog.records)
        assert reader.plan.periods["utilization_ratio"] == 2 and reader.plan.periods["energy_joules_total"] == 120
        oldest = 0.0
        for _ in range(130):
            ages = cycle(reader, clock)[0].slow_readings_age_seconds
            assert ages.get("utilization_ratio", 0.0) <= 1.0
            oldest = max([oldest, *ages.values()])
        assert oldest == 119.0
    finally:
        reader.close()


def test_cheap_fakes_read_everything_every_cycle():
    reader = NvmlReader(FakeNvml([h100(0)]), xid_wait_ms=20)
    reader.open()
    try:
        assert set(reader.plan.periods.values()) == {1}
        assert reader.read()[0].slow_readings_age_seconds == {}
    finally:
        reader.close()


def test_gpm_on_a_slower_tier_still_has_a_value_on_the_second_read():
    fake = FakeNvml([h100(0, links=0), h100(1, links=0)])
    clock = Clock()
    nvml = CostedNvml(fake, call_cost_us={"nvmlGpmSampleGet": 3000.0, **CALLS_US}, field_cost_us=FIELDS_US)
    reader = NvmlReader(nvml, xid_wait_ms=20, cpu_budget=0.004, interval_s=1.0, clock=clock)
    reader.open()
    try:
        assert reader.plan.periods["sm_active_ratio"] == 2
        cycle(reader, clock)
        assert [g.sm_active_ratio for g in cycle(reader, clock)] == [0.81, 0.81]
        before = fake.called("nvmlGpmSampleGet")
        for _ in range(4):
            ages = [g.slow_readings_age_seconds.get("sm_active_ratio", 0.0) for g in cycle(reader, clock)]
            assert max(ages) <= 1.0
        assert fake.called("nvmlGpmSampleGet") - before == 4  # every other cycle on each of two GPUs
    finally:
        reader.close()


def test_a_gpm_metric_asked_apart_is_read_at_its_own_slower_period():
    """GRAPHICS_UTIL costs a thousand times the other GPM metrics: in a call of its own, the tiers slow it
    while SM activity, asked in the shared call, stays at most 2 s old."""
    fake = FakeNvml([h100(0, links=0), h100(1, links=0)])
    fake.gpus[0].gpm_values[pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL] = 97.0
    clock = Clock()
    reader = NvmlReader(CostedNvml(fake), xid_wait_ms=20, cpu_budget=0.004, interval_s=1.0, clock=clock)
    reader.open()
    try:
        period = reader.plan.periods["graphics_active_ratio"]
        assert period >= 4 and reader.plan.periods["sm_active_ratio"] <= 2
        for _ in range(2):  # GPM's first poll has no previous sample; the second reads what it lacks
            cycle(reader, clock)
        before = fake.called("nvmlGpmMetricsGet")
        nodes = [cycle(reader, clock) for _ in range(2 * period)]
        assert all(gpus[0].graphics_active_ratio == 0.97 for gpus in nodes)
        ages = [gpus[0].slow_readings_age_seconds.get("graphics_active_ratio", 0.0) for gpus in nodes]
        assert max(ages) == period - 1 and ages.count(0.0) == 2
        shared = sum(1 for gpus in nodes for g in gpus if "sm_active_ratio" not in g.slow_readings_age_seconds)
        assert fake.called("nvmlGpmMetricsGet") - before == shared + 2 * 2  # two reads apart on each GPU
    finally:
        reader.close()


class TableCosts:
    """Forwards to an NVML object; each nvml* call advances the calling thread's CPU clock by what the cost
    table (agent.sim.costs, an H100 on driver 580) says the real call costs, and by nothing else: the
    reader's probes measure the table exactly, whatever this machine's speed or load."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._table = CostedNvml(inner)  # for its call_cost only: nothing is burned
        self._ns: dict[int, int] = {}

    def thread_time_ns(self) -> int:
        return self._ns.get(threading.get_ident(), 0)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not name.startswith("nvml") or isinstance(value, type) or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            finally:
                thread = threading.get_ident()
                self._ns[thread] = self._ns.get(thread, 0) + int(self._table.call_cost(name, args) * 1e9)

        return call


def test_the_default_tiers_fit_the_default_budget_on_an_8_gpu_h100_at_its_call_costs(caplog):
    """Every reading the simulated HGX H100 has, at the cost table's per-call figures: the detectors' readings
    at most 2 s apart, the rest within 120 s, and no over-budget warning at the defaults."""
    scenario = load_scenario("hgx-h100")
    clock = Clock()
    sim = SimNvml(scenario, node=scenario.nodes[0], clock=clock, epoch=clock.now - 300, block_on_events=True)
    table = TableCosts(sim)
    reader = NvmlReader(table, xid_wait_ms=20, interval_s=1.0, clock=clock, cpu_clock_ns=table.thread_time_ns)
    with caplog.at_level(logging.INFO, logger="gpufleet.agent.nvml_reader"):
        reader.open()
    try:
        plan = reader.plan
        assert len(reader.read()) == 8 and len(plan.periods) > 25
        assert plan.fits and plan.cost_per_second <= DEFAULT_CPU_BUDGET
        messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert "sampling tiers" in messages and not any("exceed the cpu budget" in m for m in messages)
        assert all(p in (1, 2) for k, p in plan.periods.items() if k in FAST_READINGS)
        assert all(p == INTEGRATED or p <= 120 for p in plan.periods.values())
        # A minute is not enough for the energy counter (3.2 ms a read on each GPU): it alone stretches.
        assert plan.periods["energy_joules_total"] == 120 and plan.periods["pcie_tx_bytes_total"] == 60
    finally:
        reader.close()
