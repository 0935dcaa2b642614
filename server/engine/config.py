"""Engine settings: every threshold and duration the detectors use, with its default and unit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Detection settings; durations in seconds of sample time, ratios 0-1."""

    # Cadence: samples are averaged into bins of tick_seconds; every closed bin is one evaluation.
    tick_seconds: float = 5.0
    # Bins are evaluated once now >= bin end + settle_seconds (live ingest may lag the newest sample).
    settle_seconds: float = 0.0
    # Per-GPU history kept in memory and the rolling median that suppresses jitter.
    window_seconds: float = 300.0
    smooth_seconds: float = 30.0
    # Job-level history from which a job's own baseline (a high percentile) is taken.
    baseline_seconds: float = 900.0
    baseline_percentile: float = 90.0
    min_history_seconds: float = 120.0
    # Structural offsets of a GPU against its peers are learned with this time constant.
    offset_time_constant_seconds: float = 600.0
    # GPUs of one job do the same work: a learned offset in the culprit direction is capped here.
    structural_max_offset: float = 0.05
    startup_grace_seconds: float = 90.0
    busy_utilization: float = 0.5
    job_active_utilization: float = 0.3
    # An unattributed GPU not busy for this long runs no job: it is left out of node-level comparisons.
    unattributed_idle_seconds: float = 900.0
    # ... and one running no kernels to speak of now is left out at once (see Engine._engaged).
    unattributed_running_utilization: float = 0.05

    thermal_temperature_celsius: float = 83.0
    thermal_for_seconds: float = 30.0
    thermal_clear_margin_celsius: float = 3.0
    thermal_clear_seconds: float = 30.0
    thermal_slowdown_margin_celsius: float = 2.0
    thermal_clock_cut_ratio: float = 0.85
    # HBM at its own max operating temperature (less this margin) is hot whatever the die reads: the memory
    # throttles there, and an HBM-heavy job or blocked airflow over the stacks can heat it alone.
    thermal_memory_margin_celsius: float = 0.0

    straggler_for_seconds: float = 30.0
    straggler_clear_seconds: float = 60.0
    straggler_min_group: int = 3
    straggler_min_slowdown: float = 0.04
    straggler_min_power_drop: float = 0.025
    straggler_sm_excess: float = 0.10
    straggler_power_excess: float = 0.07
    node_power_excess: float = 0.05
    straggler_clock_deficit: float = 0.08
    straggler_waiting_utilization: float = 0.7
    node_idle_gap: float = 0.12

    workload_drop: float = 0.15
    # Power moves less than SM activity for the same slowdown (a waiting GPU still draws power).
    workload_power_drop: float = 0.08
    # ... and it must also lie this many standard deviations of the job's own healthy history below
    # that history's median: a noisy job's ordinary dips are not a drop.
    workload_noise_sigmas: float = 3.0
    comm_for_seconds: float = 30.0
    input_for_seconds: float = 45.0
    workload_clear_seconds: float = 60.0
    comm_min_utilization: float = 0.8
    input_utilization_drop: float = 0.15
    workload_clock_ratio: float = 0.93
    # The same with the power-cap bit on most of a group's GPUs: then a small clock cut is the cap.
    workload_capped_clock_ratio: float = 0.98

    # A pending alert survives this long without its condition (noise around a threshold).
    pending_grace_seconds: float = 10.0
    unreachable_seconds: float = 30.0
    gpu_lost_seconds: float = 30.0
    # How long a job with a lost GPU is taken as hung in its collective (PyTorch's NCCL timeout is 10 or
    # 30 minutes): no straggler, comm_bound or input_bound in it meanwhile. A job on a node that stopped
    # answering opens no comm_bound or input_bound for as long.
    lost_gpu_hang_seconds: float = 1800.0
    # A group (a job, or a fallback) without members this long gives its id, and what was learned under
    # it, to the next new group: the engine's per-group state stays as large as the live jobs need.
    group_retention_seconds: float = 3600.0
    xid_clear_seconds: float = 600.0
    ecc_clear_seconds: float = 600.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "EngineConfig":
        """Build from a mapping (YAML/JSON config); ValueError names an unknown key or a bad value."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError("engine config must be a mapping")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in data.items():
            name = str(key).replace("-", "_").replace(".", "_")
            if name not in fields:
                raise ValueError(f"unknown engine config key {key!r}")
            values[name] = _coerce(key, raw, fields[name].type)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Reject settings the engine cannot work with."""
        if self.tick_seconds <= 0:
            raise ValueError("tick_seconds must be > 0")
        if self.smooth_seconds < self.tick_seconds:
            raise ValueError("smooth_seconds must be >= tick_seconds")
        if self.window_seconds < max(self.smooth_seconds, self.unreachable_seconds, self.gpu_lost_seconds) + 2 * self.tick_seconds:
            raise ValueError("window_seconds must exceed smooth/unreachable/gpu_lost seconds by two ticks")
        if self.group_retention_seconds < max(self.baseline_seconds, self.window_seconds):
            raise ValueError("group_retention_seconds must be >= baseline_seconds and window_seconds")
        if self.baseline_seconds < self.min_history_seconds:
            raise ValueError("baseline_seconds must be >= min_history_seconds")
        if not 0 < self.baseline_percentile <= 100:
            raise ValueError("baseline_percentile must be in (0, 100]")
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0")

    def bins(self, seconds: float) -> int:
        """Whole ticks covering a duration (at least one)."""
        return max(1, int(round(seconds / self.tick_seconds)))


def _coerce(key: Any, raw: Any, type_name: Any) -> Any:
    """Numbers only; a bool or a string is a mistake, not a number."""
    want_int = type_name in (int, "int")
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"engine config {key!r} must be a number, got {raw!r}")
    if want_int:
        if raw != int(raw):
            raise ValueError(f"engine config {key!r} must be an integer, got {raw!r}")
        return int(raw)
    value = float(raw)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"engine config {key!r} must be finite")
    return value
