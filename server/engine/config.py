"""Engine settings: every threshold and duration the detectors use, with its default and unit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Detection settings; durations in seconds of sample time, ratios 0-1."""

    # Samples are averaged into bins this long and every closed bin is one evaluation (5 s: the common
    # agent pull interval; 1 s samples average into it).
    tick_seconds: float = 5.0
    # A bin is evaluated once now >= its end + this (live ingest may lag the newest sample).
    settle_seconds: float = 0.0
    # Per-GPU history kept in memory (memory grows with GPUs x window); also bounds one advance()'s work.
    window_seconds: float = 300.0
    # Rolling median of the level readings that suppresses jitter before any comparison.
    smooth_seconds: float = 30.0
    # Job-level history of healthy ticks from which a group's own baseline is taken.
    baseline_seconds: float = 900.0
    # The baseline is this percentile of that history: the job's own recent good level, robust to dips.
    baseline_percentile: float = 90.0
    # Healthy history a group needs before its baseline, and so any job-level drop, counts.
    min_history_seconds: float = 120.0
    # Structural offsets of a GPU against its peers follow slow drift with this time constant.
    offset_time_constant_seconds: float = 600.0
    # GPUs of one job do the same work: a learned offset in the culprit direction is capped here.
    structural_max_offset: float = 0.05
    # Learning time before a GPU or group is judged; it also forgets a job's ramp-up.
    startup_grace_seconds: float = 90.0
    # A GPU at or above this utilization is busy (a straggler must be; unattributed peers are).
    busy_utilization: float = 0.5
    # A group whose median utilization is at or above this runs a job; below, it is idle or ending.
    job_active_utilization: float = 0.3
    # An unattributed GPU not busy for this long runs no job: it is left out of node-level comparisons.
    unattributed_idle_seconds: float = 900.0
    # An unattributed GPU below this utilization runs no kernels now: left out of them at once.
    unattributed_running_utilization: float = 0.05

    # Die temperature at or above this is hot (the thermal_throttle trigger, with thermal bits).
    thermal_temperature_celsius: float = 83.0
    # How long a GPU must read hot before thermal_throttle fires; a few seconds' spike never does.
    thermal_for_seconds: float = 30.0
    # Hysteresis: resolved only below the threshold (and HBM below its limit) by this much.
    thermal_clear_margin_celsius: float = 3.0
    # How long the clear condition must hold before thermal_throttle resolves.
    thermal_clear_seconds: float = 30.0
    # Critical within this of the GPU's own slowdown temperature.
    thermal_slowdown_margin_celsius: float = 2.0
    # Critical when a busy, thermally throttled GPU's SM clock is below this share of its max.
    thermal_clock_cut_ratio: float = 0.85
    # HBM at its own max operating temperature (less this margin) is hot whatever the die reads: the memory
    # throttles there, and an HBM-heavy job or blocked airflow over the stacks can heat it alone.
    thermal_memory_margin_celsius: float = 0.0

    # How long a straggler finding must hold; with the 30 s medians, anything under ~45 s is ignored.
    straggler_for_seconds: float = 30.0
    # How long a straggler must not stand out, even at 0.6x the margins, before it resolves.
    straggler_clear_seconds: float = 60.0
    # GPUs with data a group needs: a median of two cannot say which one is different.
    straggler_min_group: int = 3
    # Peers count as waiting when the group's SM activity fell this far under its baseline.
    straggler_min_slowdown: float = 0.04
    # The same on power, where SM activity is not reported (a waiting GPU still draws much of its power).
    straggler_min_power_drop: float = 0.025
    # Culprit margin: SM activity this far above the peers' median, beyond the GPU's own offset.
    straggler_sm_excess: float = 0.10
    # Culprit margin where SM activity is not reported: power this far above the peers' median.
    straggler_power_excess: float = 0.07
    # Slow-node margin on power: a node's median over its GPUs is steadier than one GPU's reading.
    node_power_excess: float = 0.05
    # Culprit margin: SM clock this far below the peers' (with slowdown bits the peers lack, a clock cut).
    straggler_clock_deficit: float = 0.08
    # Waiting peers spin in their collectives at this utilization or more.
    straggler_waiting_utilization: float = 0.7
    # A node, or a rank of a job, idling this far below its peers' utilization while they wait is host-bound.
    node_idle_gap: float = 0.12

    # comm_bound / input_bound: the job's SM activity this far under its baseline is a drop.
    workload_drop: float = 0.15
    # The same on power, where SM activity is not reported: power moves less for the same slowdown.
    workload_power_drop: float = 0.08
    # A drop must also lie this many standard deviations of the job's own healthy history below that
    # history's median: a noisy job's ordinary dips are not a drop.
    workload_noise_sigmas: float = 3.0
    # How long a comm_bound finding must hold before it fires.
    comm_for_seconds: float = 30.0
    # How long an input_bound finding must hold: a checkpoint pause of 10-20 s is not starvation.
    input_for_seconds: float = 45.0
    # How long a job must be back near its usual level before comm_bound / input_bound resolves.
    workload_clear_seconds: float = 60.0
    # A drop while the job's median utilization stays at or above this is comm_bound (spinning in NCCL).
    comm_min_utilization: float = 0.8
    # A drop with utilization this far under the job's baseline utilization is input_bound.
    input_utilization_drop: float = 0.15
    # A power drop counts only while the SM clock holds this share of its baseline: a cap cuts clocks.
    workload_clock_ratio: float = 0.93
    # The same with the power-cap bit on most of a group's GPUs: then a small clock cut is the cap.
    workload_capped_clock_ratio: float = 0.98

    # A pending alert survives this long without its condition (noise around a threshold).
    pending_grace_seconds: float = 10.0
    # node_unreachable: the node's newest sample lags the evaluation by this much beyond its usual lag.
    unreachable_seconds: float = 30.0
    # gpu_lost: a GPU missing this long from snapshots its node still sends.
    gpu_lost_seconds: float = 30.0
    # How long a job with a lost GPU is taken as hung in its collective (PyTorch's NCCL timeout is 10 or
    # 30 minutes): no straggler, comm_bound or input_bound in it meanwhile. A job on a node that stopped
    # answering opens no comm_bound or input_bound for as long.
    lost_gpu_hang_seconds: float = 1800.0
    # A group (a job, or a fallback) without members this long gives its id, and what was learned under
    # it, to the next new group: the engine's per-group state stays as large as the live jobs need.
    group_retention_seconds: float = 3600.0
    # An xid alert clears after this long without that code on that GPU.
    xid_clear_seconds: float = 600.0
    # An ecc alert clears after this long without new uncorrected errors and with no remap pending/failed.
    ecc_clear_seconds: float = 600.0

    # Without attribution, GPUs join one inferred job while their readings' changes correlate this much on
    # average: measured 0.45-0.75 within a running job, about 0 between jobs, 0.2-0.26 for two on a node.
    inferred_min_correlation: float = 0.3
    # Two groups of GPUs are one job only if they move together at least this share as much as each does
    # within itself: two jobs' step phases correlate by chance (±0.13 over a 5-minute window at 5 s), and
    # among 16 jobs of 128 GPUs two reached 0.37 and were merged on the absolute figure alone.
    inferred_min_relative_correlation: float = 0.5
    # Co-movement counts once two GPUs share as many samples as ticks in this (24: one pair's correlation
    # then within ±0.2); at 10 s sampling that takes twice as long, and early merges there joined jobs.
    inferred_min_seconds: float = 120.0
    # A reading's changes are clipped at this many robust standard deviations: a job's start or an incident
    # moves its GPUs together too, but one step must not decide a whole window's correlation.
    inferred_clip_sigmas: float = 3.0
    # Inferred jobs are re-inferred this often: membership changes at the pace of jobs, not of ticks.
    inferred_refresh_seconds: float = 60.0

    # Rules (gpufleet.server.engine.rules) switched off by name: never hold. For ablation and for a fleet
    # where one rule misfires; the engine refuses a name no detector declares.
    disabled_rules: frozenset[str] = field(default_factory=frozenset)

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
            if name == "disabled_rules":
                values[name] = _rule_names(key, raw)
            else:
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
        if (
            self.window_seconds
            < max(self.smooth_seconds, self.unreachable_seconds, self.gpu_lost_seconds) + 2 * self.tick_seconds
        ):
            raise ValueError("window_seconds must exceed smooth/unreachable/gpu_lost seconds by two ticks")
        if self.group_retention_seconds < max(self.baseline_seconds, self.window_seconds):
            raise ValueError("group_retention_seconds must be >= baseline_seconds and window_seconds")
        if self.baseline_seconds < self.min_history_seconds:
            raise ValueError("baseline_seconds must be >= min_history_seconds")
        if not 0 < self.baseline_percentile <= 100:
            raise ValueError("baseline_percentile must be in (0, 100]")
        for f in dataclasses.fields(self):
            if f.name != "disabled_rules" and getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0")

    def bins(self, seconds: float) -> int:
        """Whole ticks covering a duration (at least one)."""
        return max(1, int(round(seconds / self.tick_seconds)))


def _rule_names(key: Any, raw: Any) -> frozenset[str]:
    """A list of rule names (or one comma-separated string)."""
    if isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    if not isinstance(raw, (list, tuple, set, frozenset)) or not all(isinstance(x, str) for x in raw):
        raise ValueError(f"engine config {key!r} must be a list of rule names, got {raw!r}")
    return frozenset(raw)


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
