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

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.detectors import Context, Finding, Outcome, r3, subject_fingerprint
from gpufleet.server.engine.groups import JOB, GroupHistory, Groups
from gpufleet.server.engine.tick import SlowdownSource, Tick
from gpufleet.server.engine.rules import Rule

# The rules of this detector, as data (see gpufleet.server.engine.rules).
RULES: tuple[Rule, ...] = ()


def job_drop(
    groups: Groups, history: GroupHistory, clock_ratio: float, capped_clock_ratio: float
) -> tuple[np.ndarray, np.ndarray]:
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
    capped = groups.power_cap >= 0.5
    cut = np.where(capped, capped_clock_ratio, clock_ratio) * base_clk
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


def beyond_noise(
    sagged: np.ndarray, history: GroupHistory, source: np.ndarray, sigmas: float, threshold: np.ndarray
) -> np.ndarray:
    """Per group: does the level lie `sigmas` of the job's own noise below its history's median
    (`sagged`, from sag)? The baseline is a high percentile, so in a noisy series it sits well
    above the usual level: with the generator's noise tripled, a power-only job's half-minute median
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
    noise = np.where(sm, history.spread("sm"), history.spread("power")) / middle
    levels = np.where(sm, history.level_spread("sm"), history.level_spread("power")) / middle
    noise = np.where(np.isnan(noise), np.minimum(levels, threshold / sigmas), noise)
    return ~(sagged < sigmas * noise)


class WorkloadState:
    """GPU-hours tallies for open job-level findings."""

    def __init__(self) -> None:
        self.cost: dict[str, float] = {}
        self._fps: dict[str, tuple[int, bool]] = {}
        self._known = 0

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


def detect(tick: Tick, state: WorkloadState, context: Context) -> Outcome:
    """Job-level comm_bound / input_bound findings; none in groups whose drop is explained (a straggler,
    thermal throttling, a lost GPU: the context's `explained`), nor where someone stands out (its
    `standout`; for input_bound: by idling, its `idling`). Only an explanation clears an open alert: a GPU standing out at the weaker margins for
    a tick or two while the whole job idles or spins is noise (at 10 s sampling it reset a pending
    input_bound every minute, which then fired three minutes late); the lifecycle's pending grace
    carries the alert over it."""
    history, explained, standout, idling = context.history, context.explained, context.standout, context.idling
    cfg = tick.config
    grp = tick.groups
    reg = tick.registry
    G = grp.n_groups
    is_job = reg.is_job[:G]
    drop = tick.slowdown
    base_u = history.baseline("util")
    why = np.zeros(G, dtype=bool)  # the drop has an explanation
    if explained:
        why[list(explained)] = True
    held_comm, held_inp = why.copy(), why.copy()  # no finding now
    if standout:
        held_comm[list(standout)] = True
    if idling:
        held_inp[list(idling)] = True
    aged = tick.t - reg.first_seen[:G] >= cfg.startup_grace_seconds + cfg.min_history_seconds
    ok = is_job & (grp.size >= 2) & aged
    threshold = np.where(tick.slowdown_source == SlowdownSource.POWER, cfg.workload_power_drop, cfg.workload_drop)
    dropped = (
        ok
        & (drop >= threshold)
        & beyond_noise(tick.sag, history, tick.slowdown_source, cfg.workload_noise_sigmas, threshold)
    )
    spinning = grp.util >= cfg.comm_min_utilization
    comm = dropped & spinning & ~held_comm
    inp = (
        dropped
        & ~spinning
        & ~held_inp
        & (base_u - grp.util >= cfg.input_utilization_drop)
        & (grp.util >= cfg.job_active_utilization)
    )
    # Recovered once back within half the threshold of the job's usual level, its history's median.
    # Measured from the baseline, a noisy job rarely got there: at triple noise a comm_bound stayed
    # open 470 s past the end of its slowdown while the job's level wandered 4-6 % under the baseline.
    recovered = tick.sag < threshold / 2
    comm_clear = recovered | (grp.util < cfg.comm_min_utilization - 0.1) | why
    inp_clear = recovered | (base_u - grp.util < cfg.input_utilization_drop / 2) | why
    out = Outcome()
    by_fp = state.fingerprints(reg, is_job)
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
        if grp.size[gid] == 0 or np.isnan(drop[gid]):
            return None if grp.size[gid] else True
        return bool(comm_clear[gid] if is_comm else inp_clear[gid])

    out.clear = clear_test
    return out


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
    cost = drop * int(grp.size[gid]) * cfg.tick_seconds / 3600.0
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
        "gpu_hours_lost": round(lost, 4),
    }
    if kind is AlertKind.COMM_BOUND:
        summary = (
            f"job {job} is communication-bound: {signal} {cur:.2f} vs baseline {base:.2f} "
            f"(-{drop * 100:.0f} %) with utilization {grp.util[gid]:.2f} and no GPU standing out"
        )
    else:
        summary = (
            f"job {job} is input-bound: {signal} -{drop * 100:.0f} % and utilization "
            f"{grp.util[gid]:.2f} vs {base_util:.2f} job-wide"
        )
    sev = Severity.WARNING if drop < 0.3 else Severity.CRITICAL
    return Finding(kind, None, None, None, job, sev, summary, evidence, cost_gpu_hours=cost)
