"""Engine settings: every threshold and duration the detectors use, with its default and unit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

# A unit, not a setting: GPU-hours lost are counted from tick_seconds.
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Detection settings; durations in seconds of sample time, ratios 0-1."""

    # Samples are averaged into bins this long and every closed bin is one evaluation (5 s: the common
    # agent pull interval; 1 s samples average into it).
    tick_seconds: float = 5.0
    # A bin is evaluated once now >= its end + this (live ingest may lag the newest sample).
    settle_seconds: float = 0.0
    # Critical at this loss or more (GPU-hours per hour: the GPUs a problem slows times its slowdown): an
    # 8-GPU node's worth of time, as much as losing a node; a 20 % straggler in 16 GPUs costs 3.2.
    critical_loss_gpu_hours_per_hour: float = 8.0
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
    # A GPU's stable difference of role from its job's peers (a pipeline's last stage, an expert-heavy
    # rank: 10-20 % busier), shared with another GPU of its job within that cap, counts as its offset
    # beyond the cap once learned over this much unslowed running after its warm-up.
    role_offset_seconds: float = 120.0
    # Each GPU's (and node's) own path: its activity against its peers' followed with this time constant,
    # also while its job waits, frozen while it is named. A rank whose load drifts (mixture-of-experts
    # routing) moves along it; a fault leaves it at a moment.
    straggler_path_time_constant_seconds: float = 60.0
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
    # A busy, thermally throttled GPU's SM clock below this share of its max is cut by heat (clocks_cut).
    thermal_clock_cut_ratio: float = 0.85
    # HBM at its own max operating temperature (less this margin) is hot whatever the die reads: the memory
    # throttles there, and an HBM-heavy job or blocked airflow over the stacks can heat it alone.
    thermal_memory_margin_celsius: float = 0.0

    # How long a straggler must stand out: as a finding, or in every newest bin since it began (lifecycle).
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

    # Straggler rules (detectors/straggler RULES) at this share of their margins: weaker, they keep an open
    # straggler from clearing and hold comm_bound back, so a culprit hovering at its margin is not named,
    # cleared and named again; 0.6 sits above the generator's noise (3 robust sigmas of excess: ~4 %).
    straggler_weak_margin_ratio: float = 0.6
    # Without a learned offset only the cross-section says who holds the group back, and each GPU's
    # structural offset stays in its excess: twice the SM-activity and idle margins.
    straggler_cross_margin_ratio: float = 2.0
    # Slowdown bits name a culprit when a reading confirms them by this share of its margin: bits that
    # cost nothing measurable (a brief HW slowdown) hold nobody back.
    straggler_bits_confirm_ratio: float = 0.5
    # A culprit keeps working: its SM activity stays at this share of its usual level while its waiting
    # peers' falls 12-30 %.
    straggler_sm_kept_ratio: float = 0.85
    # The same on power, looser because an operator's cap lowers a culprit's power too (0.73 of before
    # under a 250 W cap); GPUs hung in a collective draw a quarter of theirs.
    straggler_power_kept_ratio: float = 0.5
    # A GPU shows slowdown bits when they are set in at least this share of its bins (most of them).
    straggler_slow_bits_share: float = 0.5
    # Bits on this share of a group's GPUs are the group's (a power brake on a quarter of a node): its
    # median clock is no reference, and bits set nobody apart.
    straggler_peer_slow_bits_share: float = 0.25
    # An unattributed group with more than this share of its GPUs standing out at once runs two jobs: a
    # straggler is one GPU, or a few, against many waiting peers.
    straggler_mixed_standout_share: float = 0.25
    # A shared-node culprit rises this share of the SM or power margin above its own usual level (SM
    # activity +15 % on an H100 against a 10 % margin; power +4-7 % on L40S and A100 against 7 %).
    straggler_shared_rise_ratio: float = 0.4
    # A GPU standing out by its activity excess alone holds comm_bound back only beyond this many robust
    # standard deviations of its group's excesses (0.3 % of normal noise lies beyond 3).
    straggler_standout_sigmas: float = 3.0
    # A group's robust spread is averaged over about this long: one tick's MAD among 16 GPUs ranged over
    # 1.6-4.3 % of the level in one job.
    straggler_spread_time_constant_seconds: float = 60.0
    # Per-tick learning rate of offsets while warming up: nine 5 s ticks leave 0.7^9 = 4 % of the ramp-up.
    straggler_fast_learning_ratio: float = 0.3
    # A group already running when first seen (nothing to ramp up) is judged after this share of
    # startup_grace_seconds: the fast learning has forgotten its first reading by then.
    straggler_running_grace_ratio: float = 0.5
    # The cross-section test waits until the peers have spun at waiting utilization this share of
    # startup_grace_seconds: a collective's warm-up is not waiting.
    straggler_cross_steady_ratio: float = 0.5
    # A node stands out as a whole when this share of its GPUs do (most of them: a median between two
    # jobs' GPUs moves with one slow GPU, a slow node with all).
    straggler_node_share_ratio: float = 0.5
    # "Busy while the other nodes wait" needs them idling no more than this share of node_idle_gap below
    # the node: others idling more are starved themselves (the host-idle pattern, on them).
    straggler_others_idle_ratio: float = 0.5
    # A GPU's newest reading is its newest bin's, or the one before where that has no sample: at 10 s
    # sampling every other 5 s bin is empty.
    straggler_newest_bins: int = 2
    # GPU-hours tallies of subjects quiet this long are forgotten (an alert reopened within its clear
    # time continues its tally).
    straggler_cost_keep_seconds: float = 600.0
    # GPU-hours lost are reported to this many decimals: a 5 s tick of one GPU is 0.0014 GPU-hours.
    straggler_gpu_hours_digits: int = 4
    # Peer-comparison margins widen to this many robust standard deviations of the group's usual spread
    # of that excess (0.3 % of normal noise lies beyond 3): at the generator's noise (SM and power spread
    # ~1.3 %) the fixed margins decide; with 4x the noise (4-5 %) they widen to 12-15 %.
    straggler_noise_sigmas: float = 3.0
    # A GPU whose activity against its job's median rose this much from one flat stretch to the next, at
    # one moment, while the job's median fell (detectors/straggler/steps.py): a 3 % job slowdown is a 5-10 % rise.
    straggler_step_excess: float = 0.03
    # A step's rise must also pass this many robust standard deviations of its group's rises (every GPU
    # is tested every tick: at 3 a 1,024-GPU job would see chance rises).
    straggler_step_sigmas: float = 5.0
    # A step names a GPU only where its job's median activity fell this much over the same stretches (its
    # peers wait for it: a 3 % job slowdown is a 2.9 % fall).
    straggler_step_min_slowdown: float = 0.015
    # A rise is a step where the slope within its two stretches explains under this share of it (a rank's
    # drifting load is a ramp, whose slope explains all of it).
    straggler_step_ramp_ratio: float = 0.5
    # A rise is a step only where a ramp whose slope explains all of it lies this many standard errors of
    # the slope within the stretches away (noisy bins read a drifting rank's ramp as flat by chance).
    straggler_step_ramp_sigmas: float = 2.0
    # A step's rise must also pass this many standard errors of itself, from the spread of the GPU's own
    # readings within its two stretches (a 3 % straggler's rise passes about 6 at noisy telemetry; chance
    # rises of noisy or swinging ranks under 4).
    straggler_step_noise_sigmas: float = 4.5
    # Each of the two stretches a step is measured between is this long: 24 bins, 120 readings at 1 s sampling.
    straggler_step_window_seconds: float = 120.0

    # comm_bound / input_bound: the job's SM activity this far under its baseline is a drop.
    workload_drop: float = 0.15
    # The same on power, where SM activity is not reported: power moves less for the same slowdown.
    workload_power_drop: float = 0.08
    # A drop must also lie this many standard deviations of the job's own healthy history below that
    # history's median: a noisy job's ordinary dips are not a drop.
    workload_noise_sigmas: float = 3.0
    # How long a comm_bound finding must hold before it fires.
    comm_for_seconds: float = 30.0
    # How long an input_bound finding must hold: a 10-20 s checkpoint pause shows in the 30 s medians for
    # under 25 s, in the newest bins for under 25 s, and is not starvation.
    input_for_seconds: float = 35.0
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

    # The engine's own cadence and its start-up.

    # Baselines are recomputed every this many ticks: 900 s of history moves little in 15 s, and the
    # percentile over it is the costliest step of a tick.
    baseline_refresh_ticks: int = 3
    # Fingerprint indexes are pruned every this many ticks (an hour at 5 s): rare enough to cost nothing.
    index_prune_ticks: int = 720
    # An index is pruned once it holds this many fingerprints per GPU: each GPU's current one, and as many
    # again for jobs it left, before the sweep.
    index_prune_ratio: float = 2.0
    # Noise is read from changes this many smoothing windows apart: 30 s medians 60 s apart share no sample.
    noise_lag_smooth_factor: float = 2.0
    # A group's ticks feed its history once this share of the start-up grace has passed: the first half
    # covers process start and warm-up, the second already reads the job's own level.
    startup_history_ratio: float = 0.5
    # Groups first seen within this share of the start-up grace of the engine's first sample, already
    # spinning, ran before it started (a trace cut from a longer recording, a restarted server).
    running_at_start_ratio: float = 0.5
    # Clocks away from their baseline this long are a new regime (a power cap set or lifted, application
    # clocks changed): the group's history restarts. Twice the smoothing: one 30 s median is not a regime.
    regime_change_seconds: float = 60.0
    # A tick whose level lies this share of the drop margin under the history's median stays out of the
    # history: the job's ordinary range goes in, a half-formed drop does not.
    history_max_sag_ratio: float = 0.5

    # comm_bound / input_bound beyond the settings above.

    # A job on one GPU has no collective to spin in and no peers to wait for: its drops are not judged.
    workload_min_gpus: int = 2
    # A power drop's clocks are judged against the capped ratio when the power-cap bit is on in at least
    # this share of the group's samples: most of its GPUs are at their cap.
    workload_power_cap_share_ratio: float = 0.5
    # Recovered once the job is back within this share of the drop margin of its usual level (hysteresis:
    # half the margin keeps noise at the margin from closing and reopening the alert).
    workload_recovered_ratio: float = 0.5
    # comm_bound also clears once utilization fell this far under comm_min_utilization: the GPUs stopped
    # spinning (a job ending, or now input-bound); 0.1 keeps a job at the margin from flapping.
    comm_clear_utilization_gap: float = 0.1
    # input_bound also clears once utilization is back within this share of input_utilization_drop of
    # the baseline utilization (the same hysteresis as workload_recovered_ratio).
    input_clear_utilization_ratio: float = 0.5

    # Health beyond the settings above.

    # A node's usual lag may grow by at most this share of the time passed: far above any clock's drift
    # (parts per million), far below a silent node's lag, which grows by all of it.
    unreachable_lag_drift_ratio: float = 0.02
    # gpu_lost's evidence calls a GPU up when at least this share of the bin's samples said so (a majority).
    gpu_up_share_ratio: float = 0.5

    # Peer groups inferred without attribution.

    # Without attribution, GPUs join one inferred job while their readings' changes correlate this much on
    # average: measured 0.45-0.75 within a running job, about 0 between jobs, 0.2-0.26 for two on a node.
    inferred_min_correlation: float = 0.3
    # Two groups of GPUs are one job only if they move together at least this share as much as each does
    # within itself: two jobs' step phases correlate by chance (±0.13 over a 5-minute window at 5 s), and
    # among 16 jobs of 128 GPUs two reached 0.37 and were merged on the absolute figure alone.
    inferred_min_relative_correlation: float = 0.5
    # An inferred job on several nodes holds at least this share of the clustered GPUs of each (see
    # inference._sure): a job takes a node's GPUs in blocks, less a straggler or two that stopped moving
    # with it; where ranks share no step wobble, chance clusters take a few GPUs here and a few there.
    inferred_min_node_share: float = 0.75
    # A cluster holding only half of some node's GPUs (a job sharing its nodes) is a job only if its GPUs on
    # different nodes correlate this much on average: a job moves together across its nodes (measured
    # 0.45-0.76), chance clusters of split nodes 0.34-0.35 (a node's GPUs are read at one instant).
    inferred_split_min_correlation: float = 0.4
    # An inferred job whose GPUs fall into two levels of activity this far apart, each on every node it
    # spans and closer together than the gap, is two jobs sharing its nodes (see inference._level_parts).
    inferred_split_level_ratio: float = 0.08
    # Co-movement counts once two GPUs share as many samples as ticks in this (24: one pair's correlation
    # then within ±0.2); at 10 s sampling that takes twice as long, and early merges there joined jobs.
    inferred_min_seconds: float = 120.0
    # A reading's changes are clipped at this many robust standard deviations: a job's start or an incident
    # moves its GPUs together too, but one step must not decide a whole window's correlation.
    inferred_clip_sigmas: float = 3.0
    # Inferred jobs are re-inferred this often: membership changes at the pace of jobs, not of ticks.
    inferred_refresh_seconds: float = 60.0
    # A GPU that falls out of its inferred job while the job still holds most of its node stays in the job
    # this long: a straggler stops moving with its peers as it slows them, and alone has none to be named
    # against. By then its slowed peers hold the labels (an inferred job in trouble is not re-inferred).
    inferred_keep_seconds: float = 600.0
    # The one GPU of a node left in no inferred job, where one holds the node's others, joins it when its
    # readings' changes correlate with the job's GPUs on other nodes this much on average: a rank whose
    # own wobble drowns the job's reads 0.13-0.23 (the others 0.25-0.45); two GPUs left out may be another job's.
    inferred_node_join_min_correlation: float = 0.1

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
        if self.straggler_newest_bins < 1:
            raise ValueError("straggler_newest_bins must be >= 1")
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
