"""Unit conversion, sanity limits and counter-reset detection, as pure functions."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest

from gpufleet.agent.model import GpuSample
from gpufleet.agent.nvml_values import INVALID, RULES, CounterTracker, base_name, convert


@pytest.mark.parametrize(
    ("reading", "raw", "expected"),
    [
        ("utilization_ratio", 98, 0.98),
        ("utilization_ratio", 100, 1.0),
        ("power_watts", 655_000, 655.0),
        ("power_limit_watts", 700_123, 700.123),
        ("energy_joules_total", 2_225_020_545_400, 2_225_020_545.4),
        ("sm_clock_hertz", 1980, 1_980_000_000.0),
        ("memory_clock_hertz", 9001, 9_001_000_000.0),
        ("nvlink_tx_bytes_total", 3, 3072),
        ("nvlink_link_rx_bytes_total.7", 1, 1024),
        ("throttle_seconds_total.sw_power_cap", 1_500_000_000, 1.5),
        ("temperature_celsius", -40, -40.0),
        ("pcie_tx_bytes_total", 2**63, 2**63),
        ("remapped_rows_pending", 1, True),
        ("memory_used_bytes", 0, 0),
    ],
)
def test_convert_exact(reading, raw, expected):
    value = convert(reading, raw)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("reading", "raw"),
    [
        ("utilization_ratio", 101),
        ("utilization_ratio", -1),
        ("temperature_celsius", 151),
        ("temperature_celsius", -41),
        ("temperature_celsius", 0xFFFFFFFF),
        ("power_watts", 5_000_001),
        ("sm_clock_hertz", 5001),
        ("memory_clock_hertz", 40_001),
        ("pcie_rx_bytes_total", -5),
        ("memory_temperature_celsius", math.nan),
        ("energy_joules_total", math.inf),
        ("power_watts", None),
        ("power_watts", "655"),
        ("throttle_reasons", True),
    ],
)
def test_nonsense_is_invalid(reading, raw):
    assert convert(reading, raw) is INVALID


def test_every_rule_names_a_sample_field():
    assert set(RULES) <= set(GpuSample.__slots__)
    assert base_name("throttle_seconds_total.sync_boost") == "throttle_seconds_total"


def test_counter_tracker_flags_only_backwards_counters():
    tracker = CounterTracker()
    first = {
        "energy_joules_total": 10.0,
        "power_watts": 500.0,
        "nvlink_link_tx_bytes_total": (5, None, 7),
        "throttle_seconds_total": MappingProxyType({"sw_power_cap": 2.0}),
    }
    assert tracker.check("GPU-a", first) == ()
    second = {
        "energy_joules_total": 9.0,
        "power_watts": 100.0,
        "nvlink_link_tx_bytes_total": (6, 1, 3),
        "throttle_seconds_total": MappingProxyType({"sw_power_cap": 1.0}),
    }
    assert tracker.check("GPU-a", second) == (
        "energy_joules_total",
        "nvlink_link_tx_bytes_total",
        "throttle_seconds_total",
    )
    assert tracker.check("GPU-b", second) == ()  # per GPU


def test_counter_tracker_compares_with_last_known_value_across_gaps():
    tracker = CounterTracker()
    tracker.check("GPU-a", {"pcie_tx_bytes_total": 100})
    assert tracker.check("GPU-a", {"pcie_tx_bytes_total": None}) == ()
    assert tracker.check("GPU-a", {"pcie_tx_bytes_total": 50}) == ("pcie_tx_bytes_total",)
