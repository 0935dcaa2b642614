"""The snapshot under NVIDIA dcgm-exporter's names, units and labels (`--metrics.names dcgm`).

A site's dashboards, recording rules and alerts are written against `DCGM_FI_*` series labelled `gpu`,
`UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname` (and `hpc_job`, `namespace`, `pod` where jobs
or pods are mapped). This module serves the snapshot in that form, so they work unchanged.

Which fields are served is dcgm-exporter's counters CSV (`DCGM FIELD, prometheus type, help`, `#`
comments): the one shipped here (dcgm-counters.csv) holds dcgm-exporter's default set, and a site's own
file (`--metrics.dcgm-counters`) replaces it, as `dcgm-exporter -f` does. How each field is read from the
snapshot is FIELDS, one row per field. A row without a reading is a field the agent does not read yet: it
serves no series (as does a reading a GPU does not support), and a listed field the agent cannot serve is
named once, at start. Adding a reading to the snapshot lights its field up by filling in its row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from math import isfinite
from typing import Iterable, Mapping

from gpufleet.agent.activity import NO_TOTALS, ActivityTotals
from gpufleet.agent.exposition import Family, agent_families
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot
from gpufleet.agent.part_families import dcgm_instance_rows

DEFAULT_COUNTERS_FILE = "dcgm-counters.csv"
KINDS = ("gauge", "counter", "label")
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Field:
    """How one DCGM field is read from a GpuSample: the reading times `scale` is the field in DCGM's unit."""

    reading: str | None  # GpuSample attribute; None: not available from this agent yet
    scale: float = 1.0
    unit: str = ""  # DCGM's unit, for the docs
    # Where the reading is None but this one is present, the field reads 0 (DCGM's "none yet").
    zero_if: str | None = None
    lacks: str = ""  # for a field without a reading: what the agent would have to read
    plus: str | None = None  # a second reading added to the first (a total of tx and rx)


def _not_yet(lacks: str, unit: str = "") -> Field:
    return Field(None, unit=unit, lacks=lacks)


# DCGM field -> how the agent serves it. Units: DCGM's own (MHz, MiB, mJ, %, KB), converted from the
# snapshot's base units by `scale`; PROF fields are ratios in both.
FIELDS: Mapping[str, Field] = {
    # dcgm-exporter's default set (etc/default-counters.csv)
    "DCGM_FI_DEV_SM_CLOCK": Field("sm_clock_hertz", 1e-6, "MHz"),
    "DCGM_FI_DEV_MEM_CLOCK": Field("memory_clock_hertz", 1e-6, "MHz"),
    "DCGM_FI_DEV_MEMORY_TEMP": Field("memory_temperature_celsius", unit="C"),
    "DCGM_FI_DEV_GPU_TEMP": Field("temperature_celsius", unit="C"),
    "DCGM_FI_DEV_POWER_USAGE": Field("power_watts", unit="W"),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": Field("energy_joules_total", 1e3, "mJ"),
    # DCGM serves these two as NVML's instantaneous PCIe throughput (KB/s), typed counter; the agent keeps
    # byte counters (gpufleet_gpu_pcie_bytes_total), which served under these names would break a panel.
    # Served from GPM's PCIe rates (Hopper and later), so where the board has no GPM it serves none.
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": Field("pcie_tx_bytes_per_second", 1 / 1024, "KB/s"),
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": Field("pcie_rx_bytes_per_second", 1 / 1024, "KB/s"),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": Field("pcie_replays_total"),
    "DCGM_FI_DEV_GPU_UTIL": Field("utilization_ratio", 100.0, "%"),
    "DCGM_FI_DEV_MEM_COPY_UTIL": Field("memory_utilization_ratio", 100.0, "%"),
    "DCGM_FI_DEV_ENC_UTIL": Field("encoder_utilization_ratio", 100.0, "%"),
    "DCGM_FI_DEV_DEC_UTIL": Field("decoder_utilization_ratio", 100.0, "%"),
    # The code of the last XID, 0 where the GPU delivers XID events and none came yet.
    "DCGM_FI_DEV_XID_ERRORS": Field("last_xid", zero_if="xid_errors_total"),
    "DCGM_FI_DEV_FB_FREE": Field("memory_free_bytes", 1 / MIB, "MiB"),
    "DCGM_FI_DEV_FB_USED": Field("memory_used_bytes", 1 / MIB, "MiB"),
    # DCGM serves a throughput (MiB/s) here, typed counter: GPM's NVLink rates, both directions.
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": Field(
        "nvlink_tx_bytes_per_second", 1 / MIB, "MiB/s", plus="nvlink_rx_bytes_per_second"
    ),
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": _not_yet("vGPU licence status (vGPU hosts only)"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": Field("remapped_rows_uncorrectable"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": Field("remapped_rows_correctable"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": Field("remapped_rows_failure"),
    # Beyond the default set: in dcgm-exporter's other shipped files, or for a site's own.
    "DCGM_FI_DEV_FB_TOTAL": Field("memory_total_bytes", 1 / MIB, "MiB"),
    "DCGM_FI_DEV_FB_RESERVED": Field("memory_reserved_bytes", 1 / MIB, "MiB"),
    "DCGM_FI_DEV_MAX_SM_CLOCK": Field("sm_clock_max_hertz", 1e-6, "MHz"),
    "DCGM_FI_DEV_MAX_MEM_CLOCK": Field("memory_clock_max_hertz", 1e-6, "MHz"),
    "DCGM_FI_DEV_SLOWDOWN_TEMP": Field("slowdown_temperature_celsius", unit="C"),
    "DCGM_FI_DEV_SHUTDOWN_TEMP": Field("shutdown_temperature_celsius", unit="C"),
    "DCGM_FI_DEV_GPU_MAX_OP_TEMP": Field("max_operating_temperature_celsius", unit="C"),
    "DCGM_FI_DEV_MEM_MAX_OP_TEMP": Field("memory_max_operating_temperature_celsius", unit="C"),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": Field("power_limit_watts", unit="W"),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": Field("power_management_limit_watts", unit="W"),
    "DCGM_FI_DEV_FAN_SPEED": Field("fan_speed_ratio", 100.0, "%"),
    "DCGM_FI_DEV_PSTATE": Field("performance_state"),
    # NVML's clocks-event (throttle) reasons bitmask, under DCGM's names before and after 3.3.
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": Field("throttle_reasons"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": Field("throttle_reasons"),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": Field("ecc_corrected_errors_total"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": Field("ecc_uncorrected_errors_total"),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": _not_yet("aggregate (lifetime) ECC counts"),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": _not_yet("aggregate (lifetime) ECC counts"),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": Field("remapped_rows_pending"),
    "DCGM_FI_DEV_RETIRED_SBE": _not_yet("retired pages (pre-Ampere GPUs)"),
    "DCGM_FI_DEV_RETIRED_DBE": _not_yet("retired pages (pre-Ampere GPUs)"),
    "DCGM_FI_DEV_RETIRED_PENDING": _not_yet("retired pages (pre-Ampere GPUs)"),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": Field("nvlink_crc_flit_errors_total"),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": Field("nvlink_crc_data_errors_total"),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": Field("nvlink_replay_errors_total"),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": Field("nvlink_recovery_errors_total"),
    "DCGM_FI_DEV_POWER_VIOLATION": _not_yet("NVML's violation times", "us"),
    "DCGM_FI_DEV_THERMAL_VIOLATION": _not_yet("NVML's violation times", "us"),
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": _not_yet("NVML's violation times", "us"),
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": _not_yet("NVML's violation times", "us"),
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION": _not_yet("NVML's violation times", "us"),
    "DCGM_FI_DEV_RELIABILITY_VIOLATION": _not_yet("NVML's violation times", "us"),
    # Profiling: ratios 0-1, from NVML's GPM on Hopper and later.
    "DCGM_FI_PROF_SM_ACTIVE": Field("sm_active_ratio"),
    "DCGM_FI_PROF_SM_OCCUPANCY": Field("sm_occupancy_ratio"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": Field("graphics_active_ratio"),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": Field("tensor_active_ratio"),
    "DCGM_FI_PROF_DRAM_ACTIVE": Field("dram_active_ratio"),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": Field("fp64_active_ratio"),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": Field("fp32_active_ratio"),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": Field("fp16_active_ratio"),
    "DCGM_FI_PROF_PCIE_TX_BYTES": Field("pcie_tx_bytes_per_second", unit="B/s"),
    "DCGM_FI_PROF_PCIE_RX_BYTES": Field("pcie_rx_bytes_per_second", unit="B/s"),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": Field("nvlink_tx_bytes_per_second", unit="B/s"),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": Field("nvlink_rx_bytes_per_second", unit="B/s"),
}

# `label` fields of a counters file: a label of that name on every series. (scope, attribute): a
# NodeSnapshot's or a GpuSample's; None: not available from this agent yet.
LABEL_FIELDS: Mapping[str, tuple[str, str] | None] = {
    "DCGM_FI_DRIVER_VERSION": ("node", "driver_version"),
    "DCGM_FI_NVML_VERSION": ("node", "nvml_version"),
    "DCGM_FI_DEV_SERIAL": ("gpu", "serial"),
    "DCGM_FI_DEV_VBIOS_VERSION": ("gpu", "vbios_version"),
    "DCGM_FI_DEV_BRAND": None,
    "DCGM_FI_DEV_OEM_INFOROM_VER": None,
    "DCGM_FI_DEV_ECC_INFOROM_VER": None,
    "DCGM_FI_DEV_POWER_INFOROM_VER": None,
    "DCGM_FI_DEV_INFOROM_IMAGE_VER": None,
}


class CountersError(ValueError):
    """A counters file that cannot be used; the message is one line naming the file and the line."""


@dataclass(frozen=True, slots=True)
class Counter:
    """One line of a counters file."""

    field: str
    kind: str  # gauge | counter | label
    help: str


_FIELD_NAME = re.compile(r"^DCGM_[A-Z0-9_]+$")


def parse_counters(text: str, source: str = "counters file") -> tuple[Counter, ...]:
    """dcgm-exporter's counters CSV: `FIELD, gauge|counter|label, help` per line, `#` comments, blank lines."""
    out: list[Counter] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        where = f"{source} line {number}"
        if len(parts) < 3:
            raise CountersError(f"{where}: want 'DCGM FIELD, prometheus type, help', got {line[:80]!r}")
        field, kind, help_text = parts[0], parts[1].lower(), parts[2]
        if not _FIELD_NAME.match(field):
            raise CountersError(f"{where}: {field[:80]!r} is not a DCGM field name (DCGM_FI_...)")
        if kind not in KINDS:
            raise CountersError(f"{where}: type must be {', '.join(KINDS)}, got {parts[1][:40]!r}")
        if field in seen:
            raise CountersError(f"{where}: {field} is listed twice")
        seen.add(field)
        out.append(Counter(field, kind, help_text or field))
    if not any(c.kind != "label" for c in out):
        raise CountersError(f"{source}: lists no gauge or counter")
    return tuple(out)


def load_counters(path: str | None = None) -> tuple[Counter, ...]:
    """A site's counters file, or (None) the default set shipped with the agent."""
    if path is None:
        text = resources.files("gpufleet.agent").joinpath(DEFAULT_COUNTERS_FILE).read_text("utf-8")
        return parse_counters(text, DEFAULT_COUNTERS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise CountersError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_counters(text, path)


def unservable(counters: Iterable[Counter]) -> tuple[str, ...]:
    """The listed fields this agent serves no series for: unknown to it, or not read yet."""
    out = []
    for c in counters:
        known = LABEL_FIELDS.get(c.field) if c.kind == "label" else FIELDS.get(c.field)
        if known is None or (isinstance(known, Field) and known.reading is None):
            out.append(c.field)
    return tuple(out)


class DcgmFamilies:
    """The families of one publication under dcgm-exporter's names: the agent's own health families, then
    one family per servable counter of the file. Built once per counters file; holds no snapshot."""

    def __init__(self, counters: Iterable[Counter]) -> None:
        counters = tuple(counters)
        self._labels = tuple(
            (c.field, LABEL_FIELDS[c.field]) for c in counters if c.kind == "label" and LABEL_FIELDS.get(c.field)
        )
        self._values = tuple(
            (c, FIELDS[c.field])
            for c in counters
            if c.kind != "label" and c.field in FIELDS and FIELDS[c.field].reading
        )

    def __call__(
        self, snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS
    ) -> list[Family]:
        """Agent health, then the DCGM families with at least one series (GPUs only while NVML is up)."""
        out = agent_families(snapshot, health)
        if snapshot is not None and health.nvml_up:
            ids = [(g, self._ids(snapshot, g)) for g in snapshot.gpus]
            for counter, field in self._values:
                fam = Family(counter.field, "counter_as_named" if counter.kind == "counter" else "gauge", counter.help)
                for g, (names, values) in ids:
                    value = _value(g, field)
                    if value is not None:
                        fam.rows.append((names, values, value))
                    if g.mig_instances:  # dcgm-exporter's per-instance series: FB_* and PROF_* fields
                        fam.rows += dcgm_instance_rows(g, names, values, field.reading, field.scale)  # type: ignore[arg-type]
                if fam.rows:
                    out.append(fam)
        return out

    def _ids(self, snap: NodeSnapshot, g: GpuSample) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """One GPU's label names and values, in dcgm-exporter's order (the counters file's `label` fields, then
        the job and the pod, follow where the GPU has them); an absent one is left out."""
        pairs = [
            ("gpu", str(g.index)),
            ("UUID", g.uuid),
            ("pci_bus_id", g.pci_bus_id),
            ("device", f"nvidia{g.index}"),
            ("modelName", g.model),
            ("Hostname", snap.node),
        ]
        for name, (scope, attr) in self._labels:  # type: ignore[misc]
            pairs.append((name, getattr(snap if scope == "node" else g, attr)))
        pairs.append(("hpc_job", g.hpc_job))
        if g.kubernetes_namespace and g.kubernetes_pod:
            pairs += [("namespace", g.kubernetes_namespace), ("pod", g.kubernetes_pod)]
        present = [(k, str(v)) for k, v in pairs if v]
        return tuple(k for k, _ in present), tuple(v for _, v in present)


def _value(g: GpuSample, field: Field) -> float | None:
    """The field's value in DCGM's unit, or None where the GPU does not have the reading."""
    raw = getattr(g, field.reading)  # type: ignore[arg-type]
    if raw is None and field.zero_if is not None and getattr(g, field.zero_if) is not None:
        raw = 0
    if raw is None:
        return None
    if field.plus is not None:
        other = getattr(g, field.plus)
        if other is None:
            return None
        raw += other
    value = float(raw) * field.scale
    return value if isfinite(value) else None
