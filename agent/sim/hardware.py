"""GPU models the simulator can emulate: identity, limits, clocks and the thermal and power constants.

Figures are plausible values for each product as NVML reports them, not vendor specifications.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import pynvml

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Static properties of one GPU product."""

    key: str
    name: str
    architecture: int
    pci_device_id: int
    pci_subsystem_id: int
    vbios_version: str
    memory_total_bytes: int
    memory_reserved_bytes: int
    tdp_watts: float
    idle_watts: float
    sm_clock_max_mhz: int
    sm_clock_idle_mhz: int
    mem_clock_max_mhz: int
    mem_clock_idle_mhz: int
    slowdown_celsius: int
    shutdown_celsius: int
    gpu_max_celsius: int
    # None: the board has no memory temperature sensor (GDDR cards).
    mem_max_celsius: int | None
    # Two thermal time constants in series (physics.gpu_bucket): the die and package over the heatsink
    # (fast), and the heatsink over the inlet air or coolant (slow); temperature rise per watt and time
    # constant of each. Their sum is the steady rise per watt.
    die_resistance_c_per_w: float
    die_tau_s: float
    sink_resistance_c_per_w: float
    sink_tau_s: float
    gpm_supported: bool
    nvlink_links: int
    # Usable NVLink bandwidth per direction over all links, KiB/s.
    nvlink_kib_per_s: float
    # Usable host/NIC PCIe bandwidth per direction, bytes/s.
    pcie_bytes_per_s: float
    remapped_rows_supported: bool
    # A fan the board drives (NVML's fan speed); HGX and SXM boards are cooled by the chassis: none.
    has_fan: bool = False

    @property
    def has_nvlink(self) -> bool:
        """Whether the board has NVLink links at all."""
        return self.nvlink_links > 0

    @property
    def has_memory_temperature(self) -> bool:
        """Whether the board reports an HBM temperature."""
        return self.mem_max_celsius is not None


H100_SXM = GpuModel(
    key="h100-sxm",
    name="NVIDIA H100 80GB HBM3",
    architecture=pynvml.NVML_DEVICE_ARCH_HOPPER,
    pci_device_id=0x233010DE,
    pci_subsystem_id=0x16C110DE,
    vbios_version="96.00.99.00.01",
    memory_total_bytes=81559 * _MIB,
    memory_reserved_bytes=535 * _MIB,
    tdp_watts=700.0,
    # Idle power and the shutdown threshold as a real H100 80GB HBM3 reads them on driver 580
    # (tests/fixtures/h100-driver-580/report.txt: idle 72.8-74.2 W, shutdown 95 C).
    idle_watts=74.0,
    sm_clock_max_mhz=1980,
    sm_clock_idle_mhz=345,
    mem_clock_max_mhz=2619,
    mem_clock_idle_mhz=2619,
    slowdown_celsius=89,
    shutdown_celsius=95,
    gpu_max_celsius=87,
    mem_max_celsius=95,
    # Fitted to the same run under 45 s of full load (about 615 W over idle): the die rose 13 C within the
    # first second and was back under 47 C 3 s after the load; after 45 s it read 61 C, still rising.
    die_resistance_c_per_w=0.025,
    die_tau_s=0.4,
    sink_resistance_c_per_w=0.040,
    sink_tau_s=85.0,
    gpm_supported=True,
    nvlink_links=18,
    nvlink_kib_per_s=18 * 25e9 / 1024,
    pcie_bytes_per_s=50e9,
    remapped_rows_supported=True,
)

A100_SXM4 = GpuModel(
    key="a100-sxm4",
    name="NVIDIA A100-SXM4-80GB",
    architecture=pynvml.NVML_DEVICE_ARCH_AMPERE,
    pci_device_id=0x20B210DE,
    pci_subsystem_id=0x147F10DE,
    vbios_version="92.00.45.00.06",
    memory_total_bytes=81920 * _MIB,
    memory_reserved_bytes=601 * _MIB,
    tdp_watts=400.0,
    idle_watts=60.0,
    sm_clock_max_mhz=1410,
    sm_clock_idle_mhz=210,
    mem_clock_max_mhz=1593,
    mem_clock_idle_mhz=1593,
    slowdown_celsius=89,
    shutdown_celsius=92,
    gpu_max_celsius=85,
    mem_max_celsius=95,
    # No real run of this model yet: the H100's split of the rise between die and heatsink.
    die_resistance_c_per_w=0.037,
    die_tau_s=0.4,
    sink_resistance_c_per_w=0.060,
    sink_tau_s=40.0,
    gpm_supported=False,
    nvlink_links=12,
    nvlink_kib_per_s=12 * 25e9 / 1024,
    pcie_bytes_per_s=25e9,
    remapped_rows_supported=True,
)

L40S_PCIE = GpuModel(
    key="l40s",
    name="NVIDIA L40S",
    architecture=pynvml.NVML_DEVICE_ARCH_ADA,
    pci_device_id=0x26B910DE,
    pci_subsystem_id=0x185110DE,
    vbios_version="95.02.66.00.02",
    memory_total_bytes=46068 * _MIB,
    memory_reserved_bytes=488 * _MIB,
    tdp_watts=350.0,
    idle_watts=35.0,
    sm_clock_max_mhz=2520,
    sm_clock_idle_mhz=210,
    mem_clock_max_mhz=9001,
    mem_clock_idle_mhz=405,
    slowdown_celsius=95,
    shutdown_celsius=98,
    gpu_max_celsius=88,
    mem_max_celsius=None,
    # No real run of this model yet: the H100's split of the rise between die and heatsink.
    die_resistance_c_per_w=0.051,
    die_tau_s=0.4,
    sink_resistance_c_per_w=0.082,
    sink_tau_s=60.0,
    gpm_supported=False,
    nvlink_links=0,
    nvlink_kib_per_s=0.0,
    pcie_bytes_per_s=25e9,
    remapped_rows_supported=False,
)

MODELS: Mapping[str, GpuModel] = MappingProxyType(
    {
        "h100-sxm": H100_SXM,
        "h100": H100_SXM,
        "a100-sxm4": A100_SXM4,
        "a100": A100_SXM4,
        "l40s": L40S_PCIE,
    }
)
