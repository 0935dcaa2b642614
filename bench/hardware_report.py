"""What the agent read from real NVML, per GPU and reading, from a `--record` trace (bench/hardware_check.sh).

    python -m bench.hardware_report TRACE.jsonl [SNAPSHOT.json] [METRICS.txt]

For every reading of the snapshot contract: in how many samples it was present, its range while the GPU was
idle and while it worked (utilization above half), and what breaks the contract's physics: a ratio outside
0-1, a cumulative counter going backwards, SM activity above utilization. Then the throttle reasons seen,
and the capability probe's verdicts from /metrics (`gpufleet_gpu_reading_unsupported`). A reading that is
never present is what this GPU and driver do not support: docs/hardware.md lists those.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from typing import Any, Iterable

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.model import ThrottleReason

SCALARS = (
    "utilization_ratio",
    "memory_utilization_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_celsius",
    "memory_temperature_celsius",
    "slowdown_temperature_celsius",
    "shutdown_temperature_celsius",
    "max_operating_temperature_celsius",
    "memory_max_operating_temperature_celsius",
    "power_watts",
    "power_limit_watts",
    "energy_joules_total",
    "sm_clock_hertz",
    "sm_clock_max_hertz",
    "memory_clock_hertz",
    "memory_clock_max_hertz",
    "throttle_reasons",
    "nvlink_tx_bytes_total",
    "nvlink_rx_bytes_total",
    "pcie_tx_bytes_total",
    "pcie_rx_bytes_total",
    "ecc_corrected_errors_total",
    "ecc_uncorrected_errors_total",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "xid_errors_total",
    "fan_speed_ratio",
    "performance_state",
    "encoder_utilization_ratio",
    "decoder_utilization_ratio",
    "memory_reserved_bytes",
    "power_management_limit_watts",
    "pcie_replays_total",
    "nvlink_crc_flit_errors_total",
    "nvlink_crc_data_errors_total",
    "nvlink_replay_errors_total",
    "nvlink_recovery_errors_total",
    "graphics_active_ratio",
    "tensor_active_ratio",
    "fp64_active_ratio",
    "fp32_active_ratio",
    "fp16_active_ratio",
    "dram_active_ratio",
    "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second",
    "nvlink_tx_bytes_per_second",
    "nvlink_rx_bytes_per_second",
)
RATIOS = tuple(f for f in SCALARS if f.endswith("_ratio"))
COUNTERS = tuple(f for f in SCALARS if f.endswith("_total"))
BUSY_UTILIZATION = 0.5


def read_trace(lines: Iterable[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Snapshots in time order, and a note for each line that is not JSON (skipped)."""
    out, notes = [], []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                notes.append(f"line {n}: not JSON, skipped")
    return sorted(out, key=lambda s: s.get("time", 0.0)), notes


def _range(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}..{hi:.4g}"


def report(trace: tuple[list[dict[str, Any]], list[str]]) -> list[str]:
    """The per-GPU tables and the findings for read_trace's answer, as lines of text."""
    snapshots, notes = trace
    per_gpu: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for snap in snapshots:
        for gpu in snap.get("gpus", []):
            per_gpu[gpu["index"]].append(gpu)
    lines = [f"{len(snapshots)} snapshots, {len(per_gpu)} GPU(s)", *notes]
    if snapshots:
        first = snapshots[0]
        lines.append(
            f"driver {first.get('driver_version')}, NVML {first.get('nvml_version')}, "
            f"CUDA driver {first.get('cuda_driver_version')}, "
            f"{snapshots[-1]['time'] - first['time']:.0f} s recorded"
        )
    for index, samples in sorted(per_gpu.items()):
        lines += _gpu_report(index, samples)
    return lines


def _gpu_report(index: int, samples: list[dict[str, Any]]) -> list[str]:
    busy = [g for g in samples if (g.get("utilization_ratio") or 0.0) > BUSY_UTILIZATION]
    idle = [g for g in samples if g not in busy]
    jobs = sorted({str(g["hpc_job"]) for g in busy if g.get("hpc_job")})
    lines = [
        "",
        f"GPU {index} {samples[0].get('model')} {samples[0].get('uuid')}: {len(samples)} samples, {len(busy)} busy",
        f"job while busy: {', '.join(jobs) or 'none'} "
        f"({sum(1 for g in busy if g.get('hpc_job'))}/{len(busy)} busy samples attributed)",
        f"{'reading':46} {'present':>9} {'idle':>24} {'busy':>24}",
    ]
    never = []
    for field in SCALARS:
        present = [g for g in samples if g.get(field) is not None]
        if not present:
            never.append(field)
        idle_values = [float(g[field]) for g in idle if g.get(field) is not None]
        busy_values = [float(g[field]) for g in busy if g.get(field) is not None]
        lines.append(
            f"{field:46} {len(present):>4}/{len(samples):<4} {_range(idle_values):>24} {_range(busy_values):>24}"
        )
    lines.append("never present (unsupported here): " + (", ".join(never) or "none"))
    lines += _findings(samples, busy)
    return lines


def _findings(samples: list[dict[str, Any]], busy: list[dict[str, Any]]) -> list[str]:
    out = []
    for field in RATIOS:
        bad = [g[field] for g in samples if g.get(field) is not None and not 0.0 <= g[field] <= 1.0]
        if bad:
            out.append(f"PROBLEM {field} outside 0-1: {bad[:5]}")
    for field in COUNTERS:
        values = [g[field] for g in samples if g.get(field) is not None]
        drops = sum(1 for a, b in zip(values, values[1:]) if b < a)
        if drops:
            out.append(f"note: {field} went backwards {drops} time(s) (a reset or wrap: the server takes it)")
    above = [
        g for g in busy if g.get("sm_active_ratio") is not None and g["sm_active_ratio"] > g["utilization_ratio"] + 0.05
    ]
    if above:
        out.append(f"PROBLEM sm_active_ratio above utilization_ratio in {len(above)} busy sample(s)")
    bits = 0
    for g in samples:
        bits |= int(g.get("throttle_reasons") or 0)
    out.append(
        "throttle reasons seen: " + (", ".join(r.name or hex(r.value) for r in ThrottleReason if bits & r) or "none")
    )
    nan = [f for g in samples for f, v in g.items() if isinstance(v, float) and math.isnan(v)]
    if nan:
        out.append(f"PROBLEM NaN in: {sorted(set(nan))}")
    return out


def capabilities(metrics_text: str) -> list[str]:
    """The probe's verdicts per GPU: the readings it found unsupported."""
    unsupported: dict[str, list[str]] = defaultdict(list)
    for family in text_string_to_metric_families(metrics_text):
        # gpufleet_gpu_reading_supported (value 0 = unsupported) is what agents before the rename export.
        if family.name in ("gpufleet_gpu_reading_unsupported", "gpufleet_gpu_reading_supported"):
            unsupported_value = 1 if family.name == "gpufleet_gpu_reading_unsupported" else 0
            for s in family.samples:
                if s.value == unsupported_value:
                    unsupported[s.labels.get("gpu", "?")].append(s.labels.get("reading", "?"))
    return [f"probe, GPU {gpu}: unsupported {', '.join(sorted(r))}" for gpu, r in sorted(unsupported.items())] or [
        "probe: every reading supported (no gpufleet_gpu_reading_unsupported series)"
    ]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        lines = report(read_trace(fh))
    if len(argv) > 1:
        try:
            with open(argv[1], encoding="utf-8") as fh:
                once = json.load(fh)
            lines.append(
                f"--once snapshot: {len(once.get('gpus', []))} GPU(s), "
                f"{once.get('sample_duration_seconds')} s to sample"
            )
        except (OSError, ValueError) as exc:
            lines.append(f"--once snapshot unreadable: {exc}")
    if len(argv) > 2:
        try:
            with open(argv[2], encoding="utf-8") as fh:
                lines += capabilities(fh.read())
        except (OSError, ValueError) as exc:
            lines.append(f"metrics unreadable: {exc}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
