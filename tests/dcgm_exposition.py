"""A small dcgm-exporter fleet as Prometheus would hold it, with no gpufleet agent anywhere.

Each scrape is the text dcgm-exporter 4.x serves with its stock counters (etc/default-counters.csv): its
metric names, HELP and TYPE, label names (`gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname`,
`hpc_job`, `DCGM_FI_DRIVER_VERSION`) and units (C, W, MHz, %, MiB, mJ). `backfill` turns the scrapes into
a TSDB block with promtool, as if Prometheus had scraped them (target labels `instance`, `job` added), so
that a real Prometheus serves minutes of history at once, read at pinned times: no test waits for it.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

MODEL = "NVIDIA H100 80GB HBM3"
NOT_SUPPORTED = 9223372036854775794  # DCGM's int64 "not supported", as dcgm-exporter prints it
DRIVER = "550.90.07"
# dcgm-exporter's stock counters this fleet exports: (metric, TYPE, HELP), in the shipped file's order.
COUNTERS = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
)


@dataclass(frozen=True)
class Gpu:
    """One GPU's readings at one scrape, in the contract's units; the exposition converts them to DCGM's."""

    temperature_celsius: float = 64.0
    power_watts: float = 650.0
    utilization_ratio: float = 0.98
    sm_clock_hertz: float = 1.98e9
    hbm_sensor: bool = True  # without, DCGM's "not supported" for the memory temperature


@dataclass
class Fleet:
    """Hosts of GPUs, each host's GPUs in one job; `reading(t, host, gpu)` gives a GPU's readings at time t."""

    hosts: dict[str, str]  # host -> hpc_job
    gpus_per_host: int
    reading: Callable[[float, str, int], Gpu]
    energy_mj: dict[tuple[str, int], float] = field(default_factory=dict)

    def scrape(self, t: float, dt: float, host: str) -> str:
        """The text dcgm-exporter on `host` serves at t (energy integrated over the dt since the last)."""
        rows = []
        for g in range(self.gpus_per_host):
            gpu = self.reading(t, host, g)
            self.energy_mj[(host, g)] = self.energy_mj.get((host, g), 3.6e9) + gpu.power_watts * dt * 1e3
            values = {
                "DCGM_FI_DEV_SM_CLOCK": gpu.sm_clock_hertz / 1e6,
                "DCGM_FI_DEV_MEM_CLOCK": 2619.0,
                "DCGM_FI_DEV_MEMORY_TEMP": gpu.temperature_celsius - 6.0 if gpu.hbm_sensor else NOT_SUPPORTED,
                "DCGM_FI_DEV_GPU_TEMP": gpu.temperature_celsius,
                "DCGM_FI_DEV_POWER_USAGE": gpu.power_watts,
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": round(self.energy_mj[(host, g)]),
                "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
                "DCGM_FI_DEV_GPU_UTIL": round(gpu.utilization_ratio * 100),
                "DCGM_FI_DEV_MEM_COPY_UTIL": 41,
                "DCGM_FI_DEV_ENC_UTIL": 0,
                "DCGM_FI_DEV_DEC_UTIL": 0,
                "DCGM_FI_DEV_XID_ERRORS": 0,
                "DCGM_FI_DEV_FB_FREE": 1523,
                "DCGM_FI_DEV_FB_USED": 79557,
                "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
            }
            rows.append((g, values))
        out = []
        for name, kind, doc in COUNTERS:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            for g, values in rows:
                labels = (
                    f'gpu="{g}",UUID="{uuid(host, g)}",pci_bus_id="00000000:{0x18 + 0x10 * g:02X}:00.0",'
                    f'device="nvidia{g}",modelName="{MODEL}",Hostname="{host}",'
                    f'DCGM_FI_DRIVER_VERSION="{DRIVER}",hpc_job="{self.hosts[host]}"'
                )
                out.append(f"{name}{{{labels}}} {values[name]}")
        return "\n".join(out) + "\n"


def uuid(host: str, gpu: int) -> str:
    """A stable GPU UUID per host and index, in NVML's shape."""
    digest = hashlib.sha1(f"{host}/{gpu}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-0000-{gpu:012d}"


def openmetrics(scrapes: list[tuple], job: str = "dcgm-exporter") -> str:
    """Scrapes (time, instance, exposition text[, scrape job]) as one OpenMetrics document with sample
    timestamps, the target labels a scrape adds, and each family's samples together (the format forbids
    interleaving). Counters are written as gauges: the TSDB keeps no type, and OpenMetrics would want
    `_total` names."""
    families: dict[str, list[str]] = {}
    for at, instance, text, *scrape_job in scrapes:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {**s.labels, "instance": instance, "job": scrape_job[0] if scrape_job else job}
                body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                families.setdefault(s.name, []).append(f"{s.name}{{{body}}} {s.value!r} {at:.3f}")
    out = []
    for name, lines in families.items():
        out.append(f"# TYPE {name} gauge")
        out += lines
    return "\n".join(out) + "\n# EOF\n"


def backfill(promtool: str, scrapes: list[tuple], tsdb: Path) -> None:
    """Write the scrapes into TSDB blocks under `tsdb`, for a Prometheus started on that path."""
    source = tsdb.parent / "dcgm-scrapes.om"
    source.write_text(openmetrics(scrapes))
    tsdb.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(source), str(tsdb)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def record(fleet: Fleet, start: float, seconds: float, every: float) -> list[tuple[float, str, str]]:
    """Every host scraped every `every` seconds from start for `seconds`: (time, instance, text)."""
    out = []
    for k in range(int(seconds / every) + 1):
        t = start + k * every
        for n, host in enumerate(fleet.hosts):
            at = t + 0.25 * n  # each target scraped at its own phase, as Prometheus spreads them
            out.append((at, f"{host}:9400", fleet.scrape(at, every, host)))
    return out


def ripple(t: float, host: str, gpu: int, scale: float) -> float:
    """A small deterministic wobble, as real readings have, so nothing is exactly equal."""
    return scale * math.sin(0.37 * t + 1.7 * gpu + 0.9 * len(host))
