"""A GPU whose standing against its job's peers stepped up at one moment while the peers' activity fell:
a straggler too small for the activity margins.

A GPU that slows its job by a few percent stands out from its peers by a few percent of SM activity:
under straggler_sm_excess, and within what its learned offset absorbs over minutes. But a fault starts at
a moment: the GPU's deviation from its job's median is flat before and flat after, higher by what it now
takes longer, and its job's median activity falls at the same moment by what its peers now wait. A rank
whose share of the work drifts (mixture-of-experts routing) moves as a ramp instead: its deviation
changes within each stretch as much as between them, and the job need not fall with it.

Each tick every judged GPU of a job keeps its newest bin's activity (SM activity, power where
SM activity is not reported) against its group's median of the same bin, and that median. The STEP rule
compares the stretch of straggler_step_window_seconds ending now with the one as long before it, the two
smooth_seconds apart (the gap holds the moment of the step, wherever in it). Bins are used raw, not the
30 s medians, so that each is an independent reading: 120 a stretch at 1 s sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.detectors.straggler.policy import STEP
from gpufleet.server.engine.groups import group_medians
from gpufleet.server.engine.rules import MAD_TO_SIGMA, any_of, evaluate
from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.windows import B_POWER, B_SM

_ROWS = np.array([B_SM, B_POWER])


class StepTrail:
    """Per GPU: its recent bins' deviation from its group's median and the group's median level (a ring
    of ticks), and a step found (its deviation before, its size and its job's fall; NaN: none)."""

    def __init__(self) -> None:
        self.dev = np.full((0, 0), np.nan)
        self.level = np.full((0, 0), np.nan)
        self.tick_of = np.full(0, -1, dtype=np.int64)  # the tick each ring row holds
        self.since = np.full(0, np.nan)  # per slot: the tick since which it has been judged without a break
        self.before = np.full(0, np.nan)
        self.size = np.full(0, np.nan)
        self.fall = np.full(0, np.nan)
        # The newest stretch of each recent tick, by tick: the stretch ending a gap and a stretch before a
        # later tick holds the same rows, unchanged while no slot is forgotten or added.
        self._stretches: dict[int, Stretch] = {}

    def fit(self, n: int, ring: int) -> None:
        """Grow to n slots and a ring of `ring` ticks (a new ring length starts it afresh)."""
        if self.dev.shape != (ring, n):
            self._stretches.clear()
        if self.dev.shape[0] != ring:
            self.dev, self.level = np.full((ring, n), np.nan), np.full((ring, n), np.nan)
            self.tick_of = np.full(ring, -1, dtype=np.int64)
        if self.dev.shape[1] < n:
            self.dev = np.concatenate([self.dev, np.full((ring, n - self.dev.shape[1]), np.nan)], axis=1)
            self.level = np.concatenate([self.level, np.full((ring, n - self.level.shape[1]), np.nan)], axis=1)
        self.before = grown(self.before, n, np.nan)
        self.since = grown(self.since, n, np.nan)
        self.size = grown(self.size, n, np.nan)
        self.fall = grown(self.fall, n, np.nan)

    def forget(self, slots: np.ndarray) -> None:
        """These GPUs' trails start afresh (their group's work changed)."""
        if len(slots) and self.dev.shape[1]:
            slots = slots[slots < self.dev.shape[1]]
            self._stretches.clear()
            self.dev[:, slots] = np.nan
            self.level[:, slots] = np.nan
            self.before[slots] = self.size[slots] = self.fall[slots] = self.since[slots] = np.nan

    def holds_none(self) -> bool:
        """No GPU holds a step found."""
        return bool(np.isnan(self.before).all())

    def pass_tick(self, k: int, n: int, cfg) -> None:
        """Record tick k with none of n slots judged, as find_steps does: an empty row, every slot's run
        of judged ticks broken."""
        self.fit(n, _ring_bins(cfg))
        row = k % len(self.tick_of)
        self.dev[row] = np.nan
        self.level[row] = np.nan
        self.tick_of[row] = k
        self.since[:n] = np.nan
        self._stretches.clear()

    def ready(self, k: int, cfg) -> np.ndarray:
        """Per slot: judged without a break for both stretches and the gap between them (its steps can be
        found), or holding a step found."""
        a, gap = cfg.bins(cfg.straggler_step_window_seconds), cfg.bins(cfg.smooth_seconds)
        with np.errstate(invalid="ignore"):
            return (k - self.since >= a + gap + a - 1) | ~np.isnan(self.before)

    def stretch(self, k: int, newest: int, bins: int) -> Stretch:
        """What the `bins` ticks ending `newest` ticks before tick k hold (ticks the ring lost count none)."""
        ticks = k - newest - np.arange(bins)
        rows = ticks % len(self.tick_of)
        kept = self.tick_of[rows] == ticks
        return Stretch.of(self.dev[rows[kept]], self.level[rows[kept]], -np.arange(bins, dtype=float)[kept])

    def stretches(self, k: int, bins: int, gap: int) -> tuple[Stretch, Stretch]:
        """stretch(k, 0, bins) and stretch(k, bins + gap, bins); the latter is the former of tick
        k - bins - gap where this trail worked it out then, its rows unchanged since."""
        after = self.stretch(k, 0, bins)
        then = k - bins - gap
        before = self._stretches.get(then)
        for old in [t for t in self._stretches if t <= then]:
            del self._stretches[old]
        if before is None:
            before = self.stretch(k, bins + gap, bins)
        self._stretches[k] = after
        return after, before

    def newest(self, k: int, bins: int) -> np.ndarray:
        """Per slot: the mean deviation over the `bins` ticks ending at tick k."""
        ticks = k - np.arange(bins)
        rows = ticks % len(self.tick_of)
        return _mean(self.dev[rows[self.tick_of[rows] == ticks]])


@dataclass(frozen=True, slots=True)
class Stretch:
    """Per slot, over a stretch of ticks: how many deviations it holds, their mean, their sums against
    time (for the slope within), and the group's mean median level."""

    count: np.ndarray
    mean: np.ndarray
    centred_tx: np.ndarray  # sum of (t - mean t)(x - mean x)
    centred_tt: np.ndarray  # sum of (t - mean t)^2
    centred_xx: np.ndarray  # sum of (x - mean x)^2
    level: np.ndarray

    def variance_of_mean(self) -> np.ndarray:
        """Per slot: the variance of its mean deviation, its readings' spread over their count."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.centred_xx / np.maximum(self.count - 1.0, 1.0) / self.count

    @staticmethod
    def of(dev: np.ndarray, level: np.ndarray, t: np.ndarray) -> Stretch:
        """From rows of deviations and levels (ticks, n) at times t (ticks, newest first: time runs down)."""
        known = ~np.isnan(dev)
        weight = known.astype(float)
        x = np.where(known, dev, 0.0)
        count = weight.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = x.sum(axis=0) / count
            st = t @ weight
            centred_tx = t @ x - st * mean
            centred_tt = (t * t) @ weight - st * st / count
            centred_xx = np.sum(np.square(np.where(known, dev - mean, 0.0)), axis=0)
        return Stretch(count, mean, centred_tx, centred_tt, centred_xx, _mean(level))


@dataclass(frozen=True, slots=True)
class Peers:
    """Whom each GPU's step is judged against: per slot its peer group (an index; any value where it is
    not judged), each group's size, the grouped medians of a (1, n) row, and per slot whether it counts
    in its group's median level (default: the GPUs judged)."""

    of: np.ndarray
    size: np.ndarray
    medians: Callable[[np.ndarray], np.ndarray]
    counted: np.ndarray | None = None


def job_peers(tick: Tick, group_of: np.ndarray) -> Peers:
    """Each GPU's own group this tick (its job's GPUs, attributed or inferred)."""
    members = tick.groups.members
    assert members is not None  # Engine.advance builds them with every tick's groups
    return Peers(group_of, tick.groups.size, members.layout.medians)


def node_peers(tick: Tick, loose: np.ndarray) -> Peers:
    """Per node and GPU model, its `loose` GPUs (unattributed and busy, with SM activity): the peers of
    a GPU that no inferred job holds. Whatever inference made of them, a node's GPUs of one job wait
    for its straggler as every rank does; a node's GPUs of two jobs have their steps refused by _many
    or by the median that the other job holds still."""
    w = tick.windows
    n = len(loose)
    key = np.where(loose, w.slot_node_id[:n] * (int(w.slot_model_id[:n].max(initial=0)) + 1) + w.slot_model_id[:n], -1)
    ids, of = np.unique(key, return_inverse=True)
    of = np.where(loose, of, 0).astype(np.int64)
    size = np.bincount(of[loose], minlength=len(ids))
    n_groups = len(ids)
    return Peers(of, size, lambda row: group_medians(row, np.where(loose, of, -1), n_groups), loose)


@dataclass(frozen=True, slots=True)
class Steps:
    """Per slot: a step holds (found now or before, and the GPU still stands that much above its level
    before), its size, and its job's fall at the step (NaN: none)."""

    on: np.ndarray
    size: np.ndarray
    fall: np.ndarray
    by_node: np.ndarray | None = None  # found against its node's GPUs (stages._node_steps), not its group


def find_steps(
    tick: Tick, trail: StepTrail, peers: Peers, judged: np.ndarray, sm_unknown: np.ndarray, kept: np.ndarray
) -> Steps:
    """Record this tick's bin and test every judged GPU (judged: in a job group, busy, warm, its peers
    spinning) for a step; keep those found while they stand above their level before (kept: it keeps
    its own usual activity, as a culprit does)."""
    cfg = tick.config
    n, a, gap = len(peers.of), cfg.bins(cfg.straggler_step_window_seconds), cfg.bins(cfg.smooth_seconds)
    trail.fit(n, _ring_bins(cfg))
    _record(tick, trail, peers, judged, sm_unknown)
    # The GPU judged throughout both stretches: a stretch that began in its job's settling after the
    # warm-up compares the settling with the job.
    throughout = tick.k - trail.since >= a + gap + a - 1
    if not (throughout & judged).any() and trail.holds_none():
        return Steps(np.zeros(n, dtype=bool), trail.size.copy(), trail.fall.copy())  # nothing to test or keep
    after, before = trail.stretches(tick.k, a, gap)
    # Each stretch needs a reading in every straggler_newest_bins bins at least (at 10 s sampling every
    # other 5 s bin is empty).
    enough = (after.count * cfg.straggler_newest_bins >= a) & (before.count * cfg.straggler_newest_bins >= a)
    enough &= throughout
    rise = np.where(enough & judged, after.mean - before.mean, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        fall = 1.0 - after.level / before.level
        # One slope within both stretches (each about its own mean), times the ticks between their centres:
        # as large as the rise for a ramp, about nothing for a step.
        slope = (after.centred_tx + before.centred_tx) / (after.centred_tt + before.centred_tt)
        ramp = slope * (a + gap) / rise
        # What the readings leave of that slope uncertain (its standard error, from what the slope leaves
        # unexplained within the stretches), as a share of the rise: noisy stretches show a ramp's slope as
        # flat by chance as often as not.
        tt = after.centred_tt + before.centred_tt
        unexplained = after.centred_xx + before.centred_xx - slope * (after.centred_tx + before.centred_tx)
        # Degrees of freedom: each stretch's readings less its mean, less the one slope.
        dof = (after.count - 1.0) + (before.count - 1.0) - 1.0
        residual = np.maximum(unexplained, 0.0) / np.maximum(dof, 1.0)
        ramp_error = np.sqrt(residual / tt) * (a + gap) / rise
        # The rise against what the GPU's own readings leave of either stretch's mean uncertain: noisy
        # telemetry, or a rank whose load swings within its stretches, moves the difference of two means by
        # chance more than the group's rises show where the group is small or its GPUs share the swing.
        rise_error = np.sqrt(after.variance_of_mean() + before.variance_of_mean())
    arrays = {
        "step_rise": rise,
        "step_spread": _spread(rise, peers),
        "kept": kept,
        # The peers wait for it: their median fell as it rose.
        "job_fell": fall >= cfg.straggler_step_min_slowdown,
        # A step: the slope within the stretches explains under this share of the rise (a ramp's, all).
        "flat": (rise > 0) & (ramp < cfg.straggler_step_ramp_ratio),
        # ... and a ramp that explains the whole rise is ruled out by this many standard errors of its slope.
        "not_ramp": 1.0 - ramp >= cfg.straggler_step_ramp_sigmas * ramp_error,
        # A step stands clear of the GPU's own noise: this many standard errors of the rise.
        "clear": rise >= cfg.straggler_step_noise_sigmas * rise_error,
    }
    found = any_of(evaluate(STEP, arrays, cfg), [r.name for r in STEP]) & judged
    found &= ~_many(tick, found, peers)
    new = found & np.isnan(trail.before)
    trail.before[new], trail.size[new], trail.fall[new] = before.mean[new], rise[new], fall[new]
    # A step found holds while the GPU's newest smoothing window stands the weaker share of it above its
    # level before (the weak margins' share: a culprit hovering at its margin is not cleared and named again);
    # it is forgotten once the GPU reads below that, not while it goes unjudged for a while.
    if trail.holds_none():
        return Steps(np.zeros(n, dtype=bool), trail.size.copy(), trail.fall.copy())
    above = trail.newest(tick.k, cfg.bins(cfg.smooth_seconds)) - trail.before
    held = cfg.straggler_weak_margin_ratio * trail.size
    back = above < held
    trail.before[back], trail.size[back], trail.fall[back] = np.nan, np.nan, np.nan
    on = judged & (above >= held)
    return Steps(on, trail.size.copy(), trail.fall.copy())


def _ring_bins(cfg) -> int:
    """The ticks a trail keeps: both stretches and the gap between them."""
    a, gap = cfg.bins(cfg.straggler_step_window_seconds), cfg.bins(cfg.smooth_seconds)
    return a + gap + a


def _record(tick: Tick, trail: StepTrail, peers: Peers, judged: np.ndarray, sm_unknown: np.ndarray) -> None:
    """Keep this tick's newest bin: each judged GPU's activity against its group's median of that bin."""
    now = tick.latest[_ROWS]
    act = np.where(sm_unknown, now[1], now[0])
    counted = judged if peers.counted is None else peers.counted
    level = peers.medians(np.where(counted, act, np.nan)[None, :])[0][peers.of]
    row = tick.k % len(trail.tick_of)
    with np.errstate(invalid="ignore", divide="ignore"):
        trail.dev[row] = np.where(judged, act / level - 1.0, np.nan)
    trail.level[row] = np.where(judged, level, np.nan)
    trail.tick_of[row] = tick.k
    trail.since[: len(judged)] = np.where(judged, np.fmin(trail.since[: len(judged)], tick.k), np.nan)


def _spread(rise: np.ndarray, peers: Peers) -> np.ndarray:
    """Per slot: the robust standard deviation of its group's rises (one straggler does not widen it)."""
    center = peers.medians(rise[None, :])[0][peers.of]
    return MAD_TO_SIGMA * peers.medians(np.abs(rise - center)[None, :])[0][peers.of]


def _many(tick: Tick, found: np.ndarray, peers: Peers) -> np.ndarray:
    """Per slot: more of its group stepped at once than a straggler's share (straggler_mixed_standout_share):
    a change of the job's work, not a fault."""
    counts = np.bincount(peers.of[found], minlength=len(peers.size))
    too_many = counts > np.maximum(1, np.floor(peers.size * tick.config.straggler_mixed_standout_share))
    return too_many[peers.of]


def _mean(x: np.ndarray) -> np.ndarray:
    """Per column: the mean of its known values (NaN where none)."""
    count = np.sum(~np.isnan(x), axis=0)
    return np.where(count > 0, np.nansum(x, axis=0) / np.maximum(count, 1), np.nan)
