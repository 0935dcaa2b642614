"""NvmlReader over the simulator: the same code path as real hardware yields sane values for each GPU type."""

from __future__ import annotations

import math

import pytest

from gpufleet.agent.model import GpuSample
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sim import SimNvml, load_scenario

EPOCH = 1_763_800_000.0

# Fields every simulated GPU type supports, with sane ranges.
COMMON = {
    "utilization_ratio": (0.0, 1.0),
    "memory_utilization_ratio": (0.0, 1.0),
    "memory_used_bytes": (1, 200 * 2**30),
    "memory_total_bytes": (1, 200 * 2**30),
    "temperature_celsius": (5.0, 110.0),
    "slowdown_temperature_celsius": (50.0, 120.0),
    "shutdown_temperature_celsius": (50.0, 130.0),
    "power_watts": (1.0, 1500.0),
    "power_limit_watts": (50.0, 1500.0),
    "energy_joules_total": (0.0, 1e12),
    "sm_clock_hertz": (1e8, 5e9),
    "sm_clock_max_hertz": (1e8, 5e9),
    "memory_clock_hertz": (1e8, 20e9),  # GDDR cards report the data rate (L40S: 9001 MHz)
    "memory_clock_max_hertz": (1e8, 20e9),
    "throttle_reasons": (0, 0x1FF),
    "pcie_tx_bytes_total": (0, 1 << 62),
    "pcie_rx_bytes_total": (0, 1 << 62),
    "ecc_corrected_errors_total": (0, 1 << 40),
    "ecc_uncorrected_errors_total": (0, 1 << 40),
    "xid_errors_total": (0, 1 << 20),
}
NVLINK = {"nvlink_tx_bytes_total": (0, 1 << 62), "nvlink_rx_bytes_total": (0, 1 << 62)}
GPM = {"sm_active_ratio": (0.0, 1.0), "sm_occupancy_ratio": (0.0, 1.0)}
HBM = {"memory_temperature_celsius": (5.0, 120.0)}


class FakeClock:
    """Unix time the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def read_twice(scenario_name: str) -> tuple[tuple[GpuSample, ...], NvmlReader]:
    scenario = load_scenario(scenario_name)
    clock = FakeClock(EPOCH + 60.0)
    nvml = SimNvml(scenario, node=scenario.nodes[0], clock=clock, epoch=EPOCH)
    # A budget the simulator's own Python cannot exceed: this test is about values, not sampling tiers.
    reader = NvmlReader(nvml, per_link_nvlink=True, xid_wait_ms=50, cpu_budget=1.0)
    reader.open()
    try:
        reader.read()
        clock.now += 1.0
        return reader.read(), reader
    finally:
        reader.close()


def assert_in_range(gpu: GpuSample, ranges: dict[str, tuple[float, float]]) -> None:
    for name, (low, high) in ranges.items():
        value = getattr(gpu, name)
        assert value is not None, f"GPU {gpu.index}: {name} is None"
        assert math.isfinite(value) and low <= value <= high, f"GPU {gpu.index}: {name}={value}"


@pytest.mark.parametrize(
    ("scenario", "present", "absent"),
    [
        ("hgx-h100", {**COMMON, **NVLINK, **GPM, **HBM}, ()),
        ("a100", {**COMMON, **NVLINK, **HBM}, ("sm_active_ratio", "sm_occupancy_ratio")),
        ("pcie", COMMON, ("nvlink_tx_bytes_total", "nvlink_rx_bytes_total", "sm_active_ratio")),
    ],
)
def test_reader_over_simulator(scenario, present, absent):
    gpus, reader = read_twice(scenario)
    assert gpus and all(g.up for g in gpus)
    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert len({g.uuid for g in gpus}) == len(gpus) and all(g.uuid.startswith("GPU-") for g in gpus)
    for gpu in gpus:
        assert gpu.model and gpu.pci_bus_id
        assert_in_range(gpu, present)
        assert gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.sm_clock_hertz <= gpu.sm_clock_max_hertz
        assert all(getattr(gpu, name) is None for name in absent)
        assert gpu.counter_resets == ()
    assert not [key for key in reader.errors if key[1] != "not_supported"], dict(reader.errors)


def test_h100_per_link_nvlink_and_throttle_durations():
    gpus, _ = read_twice("hgx-h100")
    for gpu in gpus:
        assert len(gpu.nvlink_link_tx_bytes_total) == 18
        assert all(v is not None and v >= 0 for v in gpu.nvlink_link_tx_bytes_total)
        assert gpu.throttle_seconds_total and all(v >= 0 for v in gpu.throttle_seconds_total.values())


def test_pcie_card_has_no_nvlink_series():
    gpus, reader = read_twice("pcie")
    assert all(g.nvlink_link_tx_bytes_total == () for g in gpus)
