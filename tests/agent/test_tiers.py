"""Fitting read periods to a CPU budget: costliest first, detectors' readings last and never past 2 s."""

from __future__ import annotations

import pytest

from gpufleet.agent.tiers import INTEGRATED, Unit, due, fit, max_period

MS = 1e-3


def units() -> list[Unit]:
    """Per-node costs shaped like an 8-GPU H100 node on driver 580 (seconds per read, all GPUs)."""
    return [
        Unit("utilization_ratio", ("utilization_ratio", "memory_utilization_ratio"), 0.36 * MS),
        Unit("sm_active_ratio", ("sm_active_ratio", "sm_occupancy_ratio"), 1.9 * MS),
        Unit("power_watts", ("power_watts",), 0.03 * MS),
        Unit("energy_joules_total", ("energy_joules_total",), 25.6 * MS),
        Unit("pcie_tx_bytes_total", ("pcie_tx_bytes_total",), 1.2 * MS),
        Unit("memory_used_bytes", ("memory_used_bytes", "memory_total_bytes"), 0.76 * MS),
        Unit(
            "throttle_seconds_total.hw_thermal_slowdown",
            ("throttle_seconds_total.hw_thermal_slowdown",),
            5.7 * MS,
            integrable=True,
        ),
    ]


def test_everything_every_cycle_when_the_budget_allows():
    plan = fit(units(), budget=1.0, interval_s=1.0)
    assert set(plan.periods.values()) == {1} and plan.fits


def test_costly_readings_slow_down_first_and_the_cheap_stay_every_cycle():
    plan = fit(units(), budget=0.004, interval_s=1.0)
    assert plan.fits and plan.cost_per_second <= 0.004
    assert plan.periods["energy_joules_total"] > 1
    assert plan.periods["throttle_seconds_total.hw_thermal_slowdown"] == INTEGRATED
    assert plan.periods["power_watts"] == plan.periods["utilization_ratio"] == 1


def test_detector_readings_slow_only_after_the_rest_reach_their_longest_period():
    plan = fit(units(), budget=0.002, interval_s=1.0)
    assert plan.periods["sm_active_ratio"] == 2
    for key in ("energy_joules_total", "pcie_tx_bytes_total", "memory_used_bytes"):
        assert plan.periods[key] == 60


def test_an_unreachable_budget_keeps_every_reading_within_its_age_bound():
    plan = fit(units(), budget=1e-6, interval_s=1.0)
    assert not plan.fits
    assert plan.periods["utilization_ratio"] == plan.periods["sm_active_ratio"] == 2
    assert plan.periods["energy_joules_total"] == plan.periods["memory_used_bytes"] == 120


def test_only_the_costliest_readings_stretch_past_a_minute_and_only_once_the_detectors_are_at_2s():
    # The detectors' readings at 2 s and the rest at 60 s cost 1.605 ms/s: energy alone at 120 s fits 1.6.
    plan = fit(units(), budget=0.0016, interval_s=1.0)
    assert plan.fits
    assert plan.periods["energy_joules_total"] == 120
    assert plan.periods["pcie_tx_bytes_total"] == plan.periods["memory_used_bytes"] == 60
    assert plan.periods["utilization_ratio"] == plan.periods["sm_active_ratio"] == 2


def test_a_throttle_counter_without_a_mask_to_stand_in_is_slowed_not_integrated():
    unit = Unit("throttle_seconds_total.hw_thermal_slowdown", ("throttle_seconds_total.hw_thermal_slowdown",), 0.01)
    assert fit([unit], budget=0.001, interval_s=1.0).periods[unit.key] == 16  # 10 ms / 16 s fits 1 ms/s


@pytest.mark.parametrize("interval, fast, slow", [(1.0, 2, 60), (0.5, 4, 120), (5.0, 1, 12), (120.0, 1, 1)])
def test_longest_periods_follow_the_interval(interval, fast, slow):
    assert (max_period(2.0, interval), max_period(60.0, interval)) == (fast, slow)


def test_gpus_read_a_slow_unit_on_different_cycles():
    period = 4
    cycles = [[c for c in range(1, 9) if due(period, c, gpu)] for gpu in range(4)]
    assert all(len(c) == 2 for c in cycles)
    assert len({c[0] for c in cycles}) == 4
    assert not due(INTEGRATED, 4, 0) and due(1, 7, 3)
