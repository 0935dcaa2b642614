"""Shared fakes for the agent runtime tests: a duck-typed NVML reader, a clock, and sample builders."""

from __future__ import annotations

import dataclasses
from typing import Callable

from gpufleet.agent.model import GpuSample, NodeSnapshot
from gpufleet.agent.nvml_reader import NvmlUnavailable

H100 = "NVIDIA H100 80GB HBM3"


def gpu(index: int, **overrides) -> GpuSample:
    """A fully populated H100 sample; override any field."""
    base = dict(
        index=index,
        uuid=f"GPU-{index:08x}-1111-2222-3333-444455556666",
        model=H100,
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        serial=f"165022001{index:04d}",
        vbios_version="96.00.99.00.01",
        utilization_ratio=0.98,
        memory_utilization_ratio=0.41,
        sm_active_ratio=0.81,
        sm_occupancy_ratio=0.32,
        memory_used_bytes=47036445491,
        memory_total_bytes=85520809984,
        memory_free_bytes=37923405824,
        temperature_celsius=71.0,
        memory_temperature_celsius=78.0,
        slowdown_temperature_celsius=87.0,
        shutdown_temperature_celsius=92.0,
        max_operating_temperature_celsius=85.0,
        memory_max_operating_temperature_celsius=95.0,
        power_watts=655.0,
        power_limit_watts=700.0,
        energy_joules_total=2225020545.4,
        sm_clock_hertz=1.98e9,
        sm_clock_max_hertz=1.98e9,
        memory_clock_hertz=2.619e9,
        memory_clock_max_hertz=2.619e9,
        throttle_reasons=0x24,
        throttle_seconds_total={"sw_power_cap": 12.5, "sw_thermal_slowdown": 3.25},
        nvlink_tx_bytes_total=73598817976388,
        nvlink_rx_bytes_total=81149436696481,
        pcie_tx_bytes_total=435114117676,
        pcie_rx_bytes_total=293621035166,
        ecc_corrected_errors_total=2,
        ecc_uncorrected_errors_total=0,
        remapped_rows_correctable=1,
        remapped_rows_uncorrectable=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
        xid_errors_total=3,
        xid_errors_by_code={79: 1, 48: 2},
        last_xid=79,
    )
    base.update(overrides)
    return GpuSample(**base)


def snapshot(n: int = 2, time: float = 1763800000.25, node: str = "dgx-017", **gpu_overrides) -> NodeSnapshot:
    """A snapshot of n populated GPUs."""
    return NodeSnapshot(
        node=node,
        time=time,
        gpus=tuple(gpu(i, **gpu_overrides) for i in range(n)),
        driver_version="550.54.15",
        nvml_version="12.550.54.15",
        cuda_driver_version="12.4",
        sample_duration_seconds=0.0042,
    )


class FakeClock:
    """Wall and monotonic time that move only when told."""

    def __init__(self, start: float = 1763800000.0) -> None:
        self.now = start
        self.mono = 1000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds


class FakeStop:
    """Stands in for threading.Event in Sampler.run: each wait advances the clock; set after `cycles` waits."""

    def __init__(self, clock: FakeClock, cycles: int) -> None:
        self.clock = clock
        self.cycles = cycles
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return len(self.waits) >= self.cycles

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        self.clock.advance(timeout or 0.0)
        return self.is_set()

    def set(self) -> None:
        self.cycles = 0


class StubReader:
    """Duck-typed NvmlReader: scripted open() failures, per-read behaviour, pids per GPU."""

    def __init__(self, gpus: int = 2, pids: dict[int, tuple[int, ...]] | None = None) -> None:
        self.gpus = gpus
        self.pids = pids or {}
        self.open_failures = 0  # the next N open() calls raise NvmlUnavailable
        self.read_effects: list[Callable[[], None] | None] = []  # popped per read; a callable may raise
        self.opened = 0
        self.closed = 0
        self.reads = 0
        self.is_open = False
        self.errors: dict[tuple[str, str], int] = {}
        self.driver_version = "550.54.15"
        self.nvml_version = "12.550.54.15"
        self.cuda_driver_version = "12.4"
        self.on_read: Callable[[int], None] | None = None

    @property
    def capabilities(self) -> dict[int, dict[str, bool]]:
        return {i: {"sm_active_ratio": True, "memory_temperature_celsius": i != 1} for i in range(self.gpus)}

    def open(self) -> None:
        self.opened += 1
        if self.open_failures:
            self.open_failures -= 1
            self.errors[("nvml_init", "driver_not_loaded")] = self.errors.get(("nvml_init", "driver_not_loaded"), 0) + 1
            raise NvmlUnavailable("nvmlInit failed: Driver Not Loaded")
        self.is_open = True

    def read(self) -> tuple[GpuSample, ...]:
        if not self.is_open:
            raise NvmlUnavailable("not open")
        self.reads += 1
        if self.read_effects:
            effect = self.read_effects.pop(0)
            if effect is not None:
                effect()
        return tuple(gpu(i, utilization_ratio=min(1.0, self.reads / 10)) for i in range(self.gpus))

    def compute_pids(self, index: int) -> tuple[int, ...]:
        return self.pids.get(index, ())

    def close(self) -> None:
        self.closed += 1
        self.is_open = False


def replace_time(snap: NodeSnapshot, time: float) -> NodeSnapshot:
    """The same snapshot at another time."""
    return dataclasses.replace(snap, time=time)
