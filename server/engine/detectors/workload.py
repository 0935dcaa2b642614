"""comm_bound / input_bound: a job whose GPUs lose activity together against the job's own baseline.

The job's median SM activity (power where SM activity is unsupported) is compared with a high
percentile of its own healthy history. Utilization still high -> the GPUs spin in collectives:
comm_bound. Utilization itself fell job-wide -> the GPUs idle waiting for data: input_bound. A power
drop only counts while clocks hold and no power-cap bits dominate (a uniform operator power cap lowers
power too, but by cutting clocks). Suppressed while a straggler / thermal alert is open in the job:
then that is the explanation, not the workload. comm_bound is also suppressed while anyone stands out
(by activity alone, only beyond the noise of its group's readings: see straggler.gpus.excess_in_noise);
input_bound only while someone stands out by idling below their peers (a host-bound node or rank). A
GPU busier than its peers makes them spin in collectives at full utilization: it cannot make the
whole job idle, and in a power-only A100 job idling half of each step, power noise set one GPU or
another 4 % over its peers most ticks and held a 40 % input-bound drop back for good.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Any, Mapping

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.detectors import Context, Finding, Outcome, r3, subject_fingerprint
from gpufleet.server.engine.detectors.spec import Detection, Detector, KindSpec
from gpufleet.server.engine.groups import JOB, GroupHistory, GroupRegistry, Groups
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.rules import Rule, any_of, evaluate
from gpufleet.server.engine.tick import SlowdownSource, Tick, newest_levels
from gpufleet.server.engine.units import PERCENT, SECONDS_PER_HOUR, VIEW_DIGITS
from gpufleet.server.engine.windows import Windows

# Gates that compare a reading with a setting: evaluated first, their results are gates of the rules below.
GATE_RULES: tuple[Rule, ...] = (
    Rule(
        name="workload_spinning",
        doc="the job's median utilization is high: its GPUs spin in collectives (gate)",
        signal="utilization",
        margin="comm_min_utilization",
    ),
    Rule(
        name="input_bound_utilization_fell",
        doc="the job's median utilization fell under its baseline utilization (gate)",
        signal="utilization_fall",
        margin="input_utilization_drop",
    ),
    Rule(
        name="workload_job_active",
        doc="the job still runs: its median utilization is at least the active level (gate)",
        signal="utilization",
        margin="job_active_utilization",
    ),
)
# The drop: the job's level under its baseline by the fixed margin (the floor), and under its history's
# median by `workload_noise_sigmas` of its own noise. Power stands in where SM activity is unsupported.
_COMM_GATES, _COMM_UNLESS = ("judged", "workload_spinning"), ("explained", "standout")
_INPUT_GATES = ("judged", "input_bound_utilization_fell", "workload_job_active")
_INPUT_UNLESS = ("workload_spinning", "explained", "idling")


def _drop(name: str, doc: str, by: str, margin: str, gates: tuple[str, ...], unless: tuple[str, ...]) -> Rule:
    """A job-level drop on one reading (`by`: sm or power)."""
    return Rule(
        name=name,
        doc=doc,
        signal=f"drop_{by}",
        margin=margin,
        spread="noise",
        sigmas="workload_noise_sigmas",
        spread_signal=f"sag_{by}",
        gates=gates,
        unless=unless,
    )


FIRE_RULES: tuple[Rule, ...] = (
    _drop(
        "comm_bound_sm_drop",
        "SM activity fell job-wide under its baseline, beyond the job's noise, while the GPUs spin",
        "sm",
        "workload_drop",
        _COMM_GATES,
        _COMM_UNLESS,
    ),
    _drop(
        "comm_bound_power_drop",
        "power fell job-wide under its baseline with clocks held, beyond the job's noise, while the GPUs spin",
        "power",
        "workload_power_drop",
        _COMM_GATES,
        _COMM_UNLESS,
    ),
    _drop(
        "input_bound_sm_drop",
        "SM activity fell job-wide under its baseline, beyond the job's noise, with utilization fallen",
        "sm",
        "workload_drop",
        _INPUT_GATES,
        _INPUT_UNLESS,
    ),
    _drop(
        "input_bound_power_drop",
        "power fell job-wide under its baseline with clocks held, beyond the job's noise, utilization fallen",
        "power",
        "workload_power_drop",
        _INPUT_GATES,
        _INPUT_UNLESS,
    ),
)
# What closes an open alert (besides an explanation: a straggler, heat, a lost GPU).
CLEAR_RULES: tuple[Rule, ...] = (
    Rule(
        name="workload_recovered_sm",
        doc="SM activity is back within a share of the margin of the job's usual level (clears)",
        signal="sag_sm",
        op="<",
        margin="workload_drop",
        factor="workload_recovered_ratio",
    ),
    Rule(
        name="workload_recovered_power",
        doc="power is back within a share of the margin of the job's usual level (clears)",
        signal="sag_power",
        op="<",
        margin="workload_power_drop",
        factor="workload_recovered_ratio",
    ),
    Rule(
        name="comm_bound_stopped_spinning",
        doc="utilization fell clearly under the spinning level: not comm_bound any more (clears)",
        signal="utilization",
        op="<",
        margin="comm_min_utilization",
        less=("comm_clear_utilization_gap",),
    ),
    Rule(
        name="input_bound_utilization_back",
        doc="utilization is back near the job's baseline utilization (clears input_bound)",
        signal="utilization_fall",
        op="<",
        margin="input_utilization_drop",
        factor="input_clear_utilization_ratio",
    ),
)
RULES: tuple[Rule, ...] = GATE_RULES + FIRE_RULES + CLEAR_RULES


def job_drop(groups: Groups, history: GroupHistory, cfg: EngineConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per group: relative activity drop vs baseline, and its source (SlowdownSource values)."""
    base_sm, base_pw, base_clk = history.baseline("sm"), history.baseline("power"), history.baseline("clock")
    drop_sm = 1.0 - groups.sm / base_sm
    drop_pw = 1.0 - groups.power / base_pw
    # A lower power is only "waiting" while clocks hold: a power cap lowers power by cutting clocks
    # (after a minute of new clocks the group's history restarts, see Engine._regime). With the
    # power-cap bit on most of the group's GPUs a small clock cut says the same: a mild cap (an A100
    # job at 300 W capped to 280 W loses 6 % of its clock and 8 % of its power) is a cap, while GPUs
    # waiting in collectives fall below their cap and keep or regain their clocks. Where clocks are
    # not reported, the bit alone says it.
    capped = groups.power_cap >= cfg.workload_power_cap_share_ratio
    cut = np.where(capped, cfg.workload_capped_clock_ratio, cfg.workload_clock_ratio) * base_clk
    clocks_hold = np.where(np.isnan(groups.clock), ~capped, ~(groups.clock < cut))
    use_sm = ~np.isnan(drop_sm)
    use_pw = ~use_sm & ~np.isnan(drop_pw) & clocks_hold
    drop = np.where(use_sm, drop_sm, np.where(use_pw, drop_pw, np.nan))
    source = np.where(use_sm, SlowdownSource.SM_ACTIVITY, np.where(use_pw, SlowdownSource.POWER, SlowdownSource.NONE))
    return drop, source


def sag(groups: Groups, history: GroupHistory, drop: np.ndarray, source: np.ndarray) -> np.ndarray:
    """Per group: how far the drop's series (see job_drop) lies below the median of its healthy
    history, as a fraction of that median: the job's distance from its usual level, where the drop is
    its distance from its best. Where the median is not known yet, the drop itself."""
    sm = source == SlowdownSource.SM_ACTIVITY
    level = np.where(sm, groups.sm, groups.power)
    middle = np.where(sm, history.median("sm"), history.median("power"))
    below = np.where(source != SlowdownSource.NONE, 1.0 - level / middle, np.nan)
    return np.where(np.isnan(below), drop, below)


def noise(history: GroupHistory, source: np.ndarray, sigmas: float, threshold: np.ndarray) -> np.ndarray:
    """Per group: the job's own noise, as a fraction of its history's median: the spread its level must
    lie `sigmas` of below that median (`sag`) for a drop to count. The baseline is a high percentile,
    so in a noisy series it sits well above the usual level: with the generator's noise tripled, a power-only job's half-minute median
    wandered 5-9 % under its baseline with nothing changed, past the 8 % threshold for half a minute
    at a time.

    The noise is read from changes a minute apart once there are enough of them (GroupHistory.spread,
    about 4 minutes of healthy history). Until then the levels' own spread stands in
    (GroupHistory.level_spread), asking at most the drop's
    own threshold below the median: at triple noise, jobs 4-5 % under their median (8-9 % under a
    baseline 4.6 % above it) opened comm_bound 4-6 minutes in. The spread overstates the noise of a
    history that holds a trend: a job climbing back from a straggler had its levels spread 5 %, and a
    real 10 % drop below its median would have been taken for noise without that cap."""
    sm = source == SlowdownSource.SM_ACTIVITY
    middle = np.where(sm, history.median("sm"), history.median("power"))
    spread = np.where(sm, history.spread("sm"), history.spread("power")) / middle
    levels = np.where(sm, history.level_spread("sm"), history.level_spread("power")) / middle
    return np.where(np.isnan(spread), np.minimum(levels, threshold / sigmas), spread)


class WorkloadState:
    """GPU-hours tallies for open job-level findings, and per group since when each kind's condition has
    held in every newest bin (NaN: not holding)."""

    def __init__(self) -> None:
        self.cost: dict[str, float] = {}
        self._fps: dict[str, tuple[int, bool]] = {}
        self._known = 0
        self.since = {True: np.zeros(0), False: np.zeros(0)}  # is_comm -> per group bin start, seconds

    def note(self, t: float, bin_seconds: float, holds: Mapping[bool, np.ndarray], unknown: np.ndarray) -> None:
        """One tick's unsmoothed conditions per kind: a run starts at its first bin's start, and a bin
        without a reading (every other bin at 10 s sampling) neither breaks it nor counts towards it."""
        for is_comm, now in holds.items():
            since = grown(self.since[is_comm], len(now), np.nan)
            started = np.where(np.isnan(since), t - bin_seconds, since)
            self.since[is_comm] = np.where(now, started, np.where(unknown, since + bin_seconds, np.nan))

    def fingerprints(self, reg, is_job: np.ndarray) -> dict[str, tuple[int, bool]]:
        """comm/input fingerprint -> (group, is_comm), extended as new job groups appear."""
        for gid in range(self._known, len(is_job)):
            if is_job[gid]:
                job = reg.job(gid)
                self._fps[subject_fingerprint(AlertKind.COMM_BOUND, None, None, job)] = (gid, True)
                self._fps[subject_fingerprint(AlertKind.INPUT_BOUND, None, None, job)] = (gid, False)
        self._known = len(is_job)
        return self._fps

    def recycle(self, gid: int, old_key: tuple) -> None:
        """The group id went from old_key to a new group: forget the old job's fingerprints and tallies,
        and register the new group's at the next fingerprints()."""
        if old_key[0] == JOB:
            for kind in (AlertKind.COMM_BOUND, AlertKind.INPUT_BOUND):
                fp = subject_fingerprint(kind, None, None, old_key[1])
                self._fps.pop(fp, None)
                self.cost.pop(fp, None)
        self._known = min(self._known, gid)
        for since in self.since.values():
            if gid < len(since):
                since[gid] = np.nan


def detect(tick: Tick, state: WorkloadState, context: Context) -> Outcome:
    """Job-level comm_bound / input_bound findings; none in groups whose drop is explained (a straggler,
    thermal throttling, a lost GPU: the context's `explained`), nor where someone stands out (its
    `standout`; for input_bound: by idling, its `idling`). The rules are RULES; the arrays they read are
    built here."""
    history = context.history
    cfg = tick.config
    grp = tick.groups
    reg = tick.registry
    G = grp.n_groups
    is_job = reg.is_job[:G]
    drop = tick.slowdown
    source = tick.slowdown_source
    base_u = history.baseline("util")
    aged = tick.t - reg.first_seen[:G] >= cfg.startup_grace_seconds + cfg.min_history_seconds
    threshold = np.where(source == SlowdownSource.POWER, cfg.workload_power_drop, cfg.workload_drop)
    by_sm, by_power = source == SlowdownSource.SM_ACTIVITY, source == SlowdownSource.POWER
    arrays: dict[str, np.ndarray] = {
        "utilization": grp.util,
        "utilization_fall": base_u - grp.util,
        "drop_sm": np.where(by_sm, drop, np.nan),
        "drop_power": np.where(by_power, drop, np.nan),
        "sag_sm": np.where(by_sm, tick.sag, np.nan),
        "sag_power": np.where(by_power, tick.sag, np.nan),
        "noise": noise(history, source, cfg.workload_noise_sigmas, threshold),
        "judged": is_job & (grp.size >= cfg.workload_min_gpus) & aged,
        "explained": _groups(G, context.explained),
        "standout": _groups(G, context.standout),
        "idling": _groups(G, context.idling),
    }
    _note_newest(tick, state, history, arrays)
    arrays.update(evaluate(GATE_RULES, arrays, cfg))
    comm, inp = _kinds(evaluate(FIRE_RULES, arrays, cfg))
    by_fp = state.fingerprints(reg, is_job)
    taken_over = {by_fp[fp][0]: ev for fp in by_fp if (ev := context.alerts.restored_evidence(fp)) is not None}
    arrays.update(_against_evidence(grp, taken_over, arrays))
    # Only an explanation or the job's return closes an alert: a GPU standing out for a tick or two while
    # the whole job idles or spins is noise (at 10 s sampling it reset a pending input_bound every
    # minute, which then fired three minutes late); the lifecycle's pending grace carries the alert over it.
    back = evaluate(CLEAR_RULES, arrays, cfg)
    recovered = any_of(back, ("workload_recovered_sm", "workload_recovered_power"))
    comm_clear = recovered | back["comm_bound_stopped_spinning"] | arrays["explained"]
    inp_clear = recovered | back["input_bound_utilization_back"] | arrays["explained"]
    out = Outcome()
    for gid in (comm | inp).nonzero()[0].tolist():
        out.add(
            _finding(
                tick, state, gid, AlertKind.COMM_BOUND if comm[gid] else AlertKind.INPUT_BOUND, base_u[gid], history
            )
        )

    def clear_test(fp: str) -> bool | None:
        hit = by_fp.get(fp)
        if hit is None:
            return None
        gid, is_comm = hit
        judged_by = np.fmax(arrays["sag_sm"][gid], arrays["sag_power"][gid]) if gid in taken_over else drop[gid]
        if grp.size[gid] == 0 or np.isnan(judged_by):
            return None if grp.size[gid] else True
        return bool(comm_clear[gid] if is_comm else inp_clear[gid])

    out.clear = clear_test
    return out


def _kinds(held: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per group: whether comm_bound, and whether input_bound holds, from FIRE_RULES' results."""
    comm = any_of(held, ("comm_bound_sm_drop", "comm_bound_power_drop"))
    return comm, any_of(held, ("input_bound_sm_drop", "input_bound_power_drop"))


def _note_newest(tick: Tick, state: WorkloadState, history: GroupHistory, arrays: Mapping[str, np.ndarray]) -> None:
    """The same rules on the job's medians of its GPUs' newest bin instead of their smoothed readings,
    noted in the state: a job-wide drop shows in every newest bin from its start, and in the 30 s medians
    only once half the window holds it."""
    grp, cfg = tick.groups, tick.config
    if grp.members is None:
        return
    newest = dataclasses.replace(grp, levels=grp.members.layout.medians(newest_levels(tick)))
    drop, source = job_drop(newest, history, cfg)
    by_sm, by_power = source == SlowdownSource.SM_ACTIVITY, source == SlowdownSource.POWER
    fall = sag(newest, history, drop, source)
    raw = dict(arrays)
    raw.update(
        utilization=newest.util,
        utilization_fall=history.baseline("util") - newest.util,
        drop_sm=np.where(by_sm, drop, np.nan),
        drop_power=np.where(by_power, drop, np.nan),
        sag_sm=np.where(by_sm, fall, np.nan),
        sag_power=np.where(by_power, fall, np.nan),
    )
    raw.update(evaluate(GATE_RULES, raw, cfg))
    comm, inp = _kinds(evaluate(FIRE_RULES, raw, cfg))
    # A job some of whose GPUs did not report lately is not judged from the others' newest bins: ranks
    # hung by a node that stopped answering read as comm_bound before node_unreachable can say why.
    partial = _partly_reported(tick)
    unknown = (np.isnan(newest.util) | np.isnan(drop)) & ~partial
    state.note(tick.t, cfg.tick_seconds, {True: comm & ~partial, False: inp & ~partial}, unknown)


def _partly_reported(tick: Tick) -> np.ndarray:
    """Per group: some of its GPUs with data have a sample in the newest straggler_newest_bins bins, and
    some have none (at 10 s sampling every other bin is empty for all of them alike)."""
    grp, k = tick.groups, tick.config.straggler_newest_bins
    gid = grp.gid
    member = (gid >= 0) & tick.has_data[: len(gid)]
    recent = np.zeros(len(gid), dtype=bool)
    if len(tick.held) >= k:
        recent = np.asarray(tick.held[:k].any(axis=0))[: len(gid)]
    n_member = np.bincount(gid[member], minlength=grp.n_groups)
    n_recent = np.bincount(gid[member & recent], minlength=grp.n_groups)
    return (n_recent > 0) & (n_recent < n_member)


def _against_evidence(
    grp: Groups, taken_over: Mapping[int, Mapping[str, Any]], arrays: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The sag and utilization fall that judge whether a job recovered, for groups whose alert was taken
    over at a restart measured against the baselines in its evidence. The history the engine began at the
    restart holds only the incident: against it the job read as recovered within a minute or two, and its
    comm_bound or input_bound resolved while the incident went on, to fire again under a new id."""
    if not taken_over:
        return {}
    out = {k: np.array(arrays[k], dtype=float) for k in ("sag_sm", "sag_power", "utilization_fall")}
    for gid, evidence in taken_over.items():
        by_sm = evidence.get("signal") == "sm_active_ratio"
        level = grp.sm[gid] if by_sm else grp.power[gid]
        out["sag_sm" if by_sm else "sag_power"][gid] = 1.0 - level / _number(evidence.get("baseline"))
        out["sag_power" if by_sm else "sag_sm"][gid] = np.nan
        out["utilization_fall"][gid] = _number(evidence.get("baseline_utilization_ratio")) - grp.util[gid]
    return out


def _number(value: Any) -> float:
    """A stored evidence value as a float (NaN when it is missing or not a number)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else np.nan


def _groups(n: int, ids: AbstractSet[int]) -> np.ndarray:
    """A per-group mask of the given group ids."""
    mask = np.zeros(n, dtype=bool)
    if ids:
        mask[list(ids)] = True
    return mask


def _finding(
    tick: Tick, state: WorkloadState, gid: int, kind: AlertKind, base_util: float, history: GroupHistory
) -> Finding:
    """Evidence and cost for one job-level drop."""
    cfg = tick.config
    grp = tick.groups
    job = tick.registry.job(gid)
    drop = float(tick.slowdown[gid])
    by_sm = tick.slowdown_source[gid] == SlowdownSource.SM_ACTIVITY
    fp = subject_fingerprint(kind, None, None, job)
    cost = drop * int(grp.size[gid]) * cfg.tick_seconds / SECONDS_PER_HOUR
    lost = state.cost.get(fp, 0.0) + cost
    state.cost[fp] = lost
    signal = "sm_active_ratio" if by_sm else "power_watts"
    base = history.baseline("sm" if by_sm else "power")[gid]
    cur = grp.sm[gid] if by_sm else grp.power[gid]
    evidence = {
        "signal": signal,
        "baseline": r3(base),
        "current": r3(cur),
        "drop_ratio": r3(drop),
        "utilization_ratio": r3(grp.util[gid]),
        "baseline_utilization_ratio": r3(base_util),
        "sm_clock_ratio": r3(grp.clock[gid]),
        "gpus": int(grp.size[gid]),
        "estimated_job_slowdown_ratio": r3(drop),
        "gpu_hours_lost": round(lost, VIEW_DIGITS),
    }
    # Its usual level first and what the job does instead: "0.52 vs baseline 0.69" says neither.
    level = (
        f"SM activity {cur:.2f} against its usual {base:.2f}"
        if by_sm
        else f"power {cur:.0f} W against its usual {base:.0f} W"
    )
    gpus = int(grp.size[gid])
    if kind == AlertKind.COMM_BOUND:
        summary = (
            f"job {job} is communication-bound: its {gpus} GPUs stay busy but compute less, waiting in "
            f"collectives ({level}, -{drop * PERCENT:.0f} %; utilization {grp.util[gid]:.2f}), and no GPU "
            "stands out"
        )
    else:
        summary = (
            f"job {job} is input-bound: its {gpus} GPUs idle, waiting for data (utilization "
            f"{grp.util[gid]:.2f} against its usual {base_util:.2f}; {level}, -{drop * PERCENT:.0f} %)"
        )
    # What it costs decides whether it is critical (engine/severity.py): nothing is lost or corrupted.
    sev = Severity.WARNING
    since = float(state.since[kind == AlertKind.COMM_BOUND][gid])
    return Finding(
        kind,
        None,
        None,
        None,
        job,
        sev,
        summary,
        evidence,
        cost_gpu_hours=cost,
        held_since=None if np.isnan(since) else since,
    )


def _detect(tick: Tick, state: WorkloadState, context: Context) -> Detection:
    """detect(), its findings split by kind."""
    both = detect(tick, state, context)
    return Detection(outcomes={kind: _only(both, kind) for kind in (AlertKind.COMM_BOUND, AlertKind.INPUT_BOUND)})


def _only(outcome: Outcome, kind: AlertKind) -> Outcome:
    """The part of a shared outcome that belongs to one kind."""
    return Outcome({fp: f for fp, f in outcome.findings.items() if f.kind == kind}, outcome.clear)


def _recycle(state: WorkloadState, gid: int, old_key: tuple, registry: GroupRegistry, windows: Windows) -> None:
    state.recycle(gid, old_key)


DETECTOR: Detector[WorkloadState] = Detector(
    name="workload",
    kinds=(
        KindSpec(
            kind=AlertKind.COMM_BOUND,
            advice="Every GPU of the job waits in collectives: check the fabric (NVLink, InfiniBand or "
            "RoCE errors, congestion, a changed topology).",
            for_setting="comm_for_seconds",
            clear_setting="workload_clear_seconds",
            costs=True,
            without=(("sm_active_ratio", "measures the job's drop by power, and only while clocks hold"),),
        ),
        KindSpec(
            kind=AlertKind.INPUT_BOUND,
            advice="The GPUs starve for input: check data loading, storage and the hosts' CPUs.",
            for_setting="input_for_seconds",
            clear_setting="workload_clear_seconds",
            costs=True,
            # Not comm_bound: at quadruple noise a power-only job's newest-bin median held its drop from
            # 15 s before one GPU's power brake, and with that bin's more lead fired before the straggler
            # explained it. input_bound's newest bins must also show a utilization fall, noise does not.
            onset_after_median=True,
        ),
    ),
    rules=RULES,
    state=WorkloadState,
    detect=_detect,
    recycle=_recycle,
)
