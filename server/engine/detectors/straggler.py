"""straggler: the GPU (or node) that holds its peer group back, never the peers waiting for it.

Physics: in synchronous training one slow participant makes everyone else wait in collectives. The
waiting peers keep utilization high but lose SM activity and power against the group's own baseline;
the culprit stays busy (its SM activity stays high relative to the peers), or runs lower clocks, or
shows throttle / power-brake / HW-slowdown bits. A host-bound node, or a single rank waiting on its own
host, shows its GPUs idle (utilization low) while the rest of the job waits.

Every comparison is against a GPU's *own* learned offset from its peers, learned while the group is
not slowed, so slot position or silicon differences that were there all along never stand out. A GPU
is only judged after startup_grace_seconds of being busy in its group, and only while the group as a
whole is active and measurably slowed (which also rules out jitter, wind-down and uniform power caps).
"""

from __future__ import annotations

import math

import numpy as np

from server.alerts import AlertKind, Severity
from server.engine.detectors import FingerprintIndex, Finding, Outcome, r3, subject_fingerprint
from server.engine.groups import JOB, GroupLayout
from server.engine.reduce import equal, nan_median_first_axis, nan_to_zero
from server.engine.tick import Tick
from server.engine.windows import B_CLOCK_RATIO, B_POWER, B_SLOW, B_SM, B_UTIL

_SM, _PW, _CLK, _UTIL = range(4)
# Binned rows of the newest readings: the levels (as groups.LEVELS), then the slowdown-bit share.
_NOW_ROWS = np.array([B_SM, B_POWER, B_CLOCK_RATIO, B_UTIL, B_SLOW])
_FAST_ALPHA = 0.3
_COST_KEEP_SECONDS = 600.0
_PAIR_KEY = 1 << 24


class StragglerState:
    """What the straggler detector learns across ticks: structural offsets and time on the job."""

    def __init__(self) -> None:
        self.offset = np.full((4, 0), np.nan)
        self.level_sm = np.full(0, np.nan)
        self.learned_gid = np.full(0, -1, dtype=np.int64)
        self.learned = np.zeros(0, dtype=np.int64)
        self.pair_index: dict[tuple[int, int], int] = {}
        self.pair_fps: list[str] = []
        self.pair_offset = np.full((2, 0), np.nan)
        self.pair_learned = np.zeros(0, dtype=np.int64)
        self.cost: dict[str, tuple[float, float]] = {}
        self._steady = np.full(0, np.nan)
        self._all_keys: list[int] = []
        self._pair_keys = np.zeros(0, dtype=np.int64)
        self._pair_vals = np.zeros(0, dtype=np.int64)
        self._node_fps: dict[tuple[int, int], str] = {}
        self._node_layout: _NodePairs | None = None

    def forget(self, slots: np.ndarray) -> None:
        """Learn these GPUs afresh (their group's work changed)."""
        if len(slots):
            self.fit(int(slots.max()) + 1)
            self.offset[:, slots] = np.nan
            self.level_sm[slots] = np.nan
            self.learned[slots] = 0

    def fit(self, n: int) -> None:
        """Grow per-slot arrays to n slots."""
        have = len(self.level_sm)
        if n <= have:
            return
        pad = n - have
        self.offset = np.concatenate([self.offset, np.full((4, pad), np.nan)], axis=1)
        self.level_sm = np.concatenate([self.level_sm, np.full(pad, np.nan)])
        self.learned_gid = np.concatenate([self.learned_gid, np.full(pad, -1, dtype=np.int64)])
        self.learned = np.concatenate([self.learned, np.zeros(pad, dtype=np.int64)])

    def add_cost(self, fp: str, t: float, gpu_hours: float) -> float:
        """Accumulate GPU-hours lost for a subject; returns the total so far."""
        total, _ = self.cost.get(fp, (0.0, t))
        total += gpu_hours
        self.cost[fp] = (total, t)
        return total

    def steady_since(self, tick: Tick, cfg) -> np.ndarray:
        """Per group: since when its median utilization has been at the 'waiting' level (NaN: not now)."""
        grp = tick.groups
        have = len(self._steady)
        if have < grp.n_groups:
            self._steady = np.concatenate([self._steady, np.full(grp.n_groups - have, np.nan)])
        steady = grp.util >= cfg.straggler_waiting_utilization
        self._steady[:grp.n_groups] = np.where(steady, np.fmin(self._steady[:grp.n_groups], tick.t), np.nan)
        return self._steady[:grp.n_groups]

    def pair_slots(self, tick: Tick, gids: np.ndarray, nids: np.ndarray) -> np.ndarray:
        """Vectorised pair_slot: a sorted key table answers known pairs without Python per pair."""
        keys = gids * _PAIR_KEY + nids
        pos = np.searchsorted(self._pair_keys, keys)
        pos = np.minimum(pos, max(len(self._pair_keys) - 1, 0))
        known = (len(self._pair_keys) > 0) & (self._pair_keys[pos] == keys) if len(self._pair_keys) else np.zeros(len(keys), bool)
        if not known.all():
            for gg, nn in zip(gids[~known].tolist(), nids[~known].tolist()):
                self.pair_slot(tick, gg, nn)
            order = np.argsort(self._all_keys)
            self._pair_keys, self._pair_vals = np.asarray(self._all_keys)[order], np.arange(len(self._all_keys))[order]
            pos = np.searchsorted(self._pair_keys, keys)
        return self._pair_vals[pos]

    def node_pairs(self, tick: Tick, ng: np.ndarray, sel: np.ndarray, node_id: np.ndarray) -> "_NodePairs | None":
        """The (group, node) pairs of this tick's node-level members; None when no group spans two nodes.

        Membership rarely changes between ticks, so the layout is kept until the node-level group ids, the
        set of GPUs with data, or the number of nodes or groups change.
        """
        n_nodes, n_groups = len(tick.windows.node_names), tick.groups.n_groups
        lay = self._node_layout
        if (lay is not None and lay.n_nodes == n_nodes and lay.n_groups == n_groups
                and equal(lay.ng, ng) and equal(lay.sel, sel)):
            return lay.usable
        lay = self._node_layout = _NodePairs(self, tick, ng.copy(), sel.copy(), node_id, n_nodes, n_groups)
        return lay.usable

    def pair_slot(self, tick: Tick, gid: int, nid: int) -> int:
        """Index of a (group, node) pair in the node-offset arrays, registering it when new."""
        i = self.pair_index.get((gid, nid))
        if i is None:
            i = self.pair_index[(gid, nid)] = len(self.pair_fps)
            self._all_keys.append(gid * _PAIR_KEY + nid)
            self.pair_fps.append(self.node_fingerprint(tick, gid, nid))
            self.pair_offset = np.concatenate([self.pair_offset, np.full((2, 1), np.nan)], axis=1)
            self.pair_learned = np.append(self.pair_learned, 0)
        return i

    def node_fingerprint(self, tick: Tick, gid: int, nid: int) -> str:
        """Memoised fingerprint of a node-level straggler subject."""
        fp = self._node_fps.get((gid, nid))
        if fp is None:
            fp = self._node_fps[(gid, nid)] = subject_fingerprint(
                AlertKind.STRAGGLER, tick.windows.node_names[nid], None, tick.registry.job(gid))
        return fp

    def prune(self, t: float) -> None:
        """Forget cost tallies of subjects quiet for a long time."""
        stale = [fp for fp, (_, last) in self.cost.items() if t - last > _COST_KEEP_SECONDS]
        for fp in stale:
            del self.cost[fp]


class _NodePairs:
    """Node-level members grouped into (group, node) pairs, and the pairs of groups spanning 2+ nodes."""

    def __init__(self, state: StragglerState, tick: Tick, ng: np.ndarray, sel: np.ndarray, node_id: np.ndarray,
                 n_nodes: int, n_groups: int) -> None:
        self.ng, self.sel, self.n_nodes, self.n_groups = ng, sel, n_nodes, n_groups
        key = ng[sel] * n_nodes + node_id[sel]
        uniq, self.inv = np.unique(key, return_inverse=True)
        self.pair_group, pair_node = uniq // n_nodes, uniq % n_nodes
        self.per_group = np.bincount(self.pair_group, minlength=n_groups)
        multi = self.per_group[self.pair_group] >= 2
        self.usable = self if multi.any() else None
        self.sel_pairs = np.flatnonzero(multi)
        self.gids, self.nids = self.pair_group[self.sel_pairs], pair_node[self.sel_pairs]
        self.idx = state.pair_slots(tick, self.gids, self.nids) if self.usable else self.sel_pairs
        # Pairs are registered in the order first seen, so the index is usually a plain range: a slice
        # reads and writes the learned offsets without copying through fancy indexing.
        if len(self.idx) and np.array_equal(self.idx, np.arange(self.idx[0], self.idx[0] + len(self.idx))):
            self.idx = slice(int(self.idx[0]), int(self.idx[0]) + len(self.idx))
        slots = range(len(state.pair_fps))[self.idx] if isinstance(self.idx, slice) else self.idx.tolist()
        self.pairs = {state.pair_fps[i]: (int(gg), int(nn)) for i, gg, nn in zip(slots, self.gids.tolist(),
                                                                                 self.nids.tolist())}
        # Grouped medians over the same membership every tick: GPUs into pairs, pairs into groups.
        self.members = GroupLayout(self.inv, len(uniq), np.flatnonzero(sel))
        self.nodes_of_group = GroupLayout(self.pair_group, n_groups)
        self.three_or_more = bool((self.per_group >= 3).any())


class Result:
    """Straggler outcome plus which groups have someone standing out (suppresses comm/input-bound)."""

    def __init__(self, outcome: Outcome, standout_groups: set[int]) -> None:
        self.outcome = outcome
        self.standout_groups = standout_groups


def detect(tick: Tick, state: StragglerState, index: FingerprintIndex, halted: set[int] = frozenset()) -> Result:
    """GPU-level and node-level straggler findings for this tick (none in halted groups: a job hung by a
    lost GPU has no straggler among the GPUs left)."""
    cfg = tick.config
    n = tick.windows.n
    state.fit(n)
    if tick.groups.n_groups == 0:
        return Result(Outcome(), set())
    grp = tick.groups
    g = grp.gid
    _reset_moved(state, g)
    m = tick.med
    u, sm = m["util"], m["sm"]
    in_group = g >= 0
    gi = np.where(in_group, g, 0)
    peers = grp.levels[:, gi]                                 # each slot's group medians
    gsm = peers[_SM]
    dev = _deviation(tick.levels, peers)
    (group_ok, cross_ok, dropped, wait_util, active, in_job,
     measured) = _group_conditions(tick, state, cfg, halted)[:, gi] & in_group
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    busy = (u >= cfg.busy_utilization) & in_group
    eligible = busy & (state.learned[:n] >= warm_ticks) & group_ok
    gslow = grp.slow[gi]
    cut, victim = _cuts(tick, cfg, dev, gslow, gi, in_group)
    ex = dev - nan_to_zero(state.offset)
    # Peers at high utilization far below one GPU's activity are spinning, i.e. waiting for it,
    # even when the job never had a healthy baseline (a straggler from the start).
    gsm_unknown = np.isnan(gsm)
    plain = np.where(gsm_unknown, ex[_PW] / cfg.straggler_power_excess, ex[_SM] / (2 * cfg.straggler_sm_excess))
    # One rank waiting on its own host (a slow input pipeline, extra host-side work on rank 0, a checkpoint
    # written by rank 0 alone) idles while its peers spin in the collective at full utilization:
    # utilization below theirs, beyond its learned offset, is the culprit direction too. Only within a job:
    # an unattributed GPU idling more than its node's others may just run other work. A GPU that was never
    # warm (idle or far below its peers from the start) is judged by the cross-section alone, a gap of
    # twice the margin as for activity, and only while it computes at all: a GPU of the allocation the
    # job never uses holds nobody back.
    starved = in_job & ~victim
    idle_cross = starved & (u >= cfg.job_active_utilization) & (-dev[_UTIL] >= 2 * cfg.node_idle_gap)
    idle = starved & (-ex[_UTIL] >= _SCALES * cfg.node_idle_gap) | idle_cross
    eligible |= idle[1] & (state.learned[:n] >= warm_ticks) & group_ok
    cross = in_job & ((plain >= 1.0) | cut | idle_cross)
    eligible_cross = ((busy & cross) | idle_cross) & cross_ok
    waiting = (dropped | cross) & wait_util
    sig, weak = ((_signals(cfg, ex, sm, state.level_sm, gsm_unknown, m["slow"], gslow) | cut) & ~victim) | idle
    on = (eligible | eligible_cross) & waiting & sig
    on &= _standing_now(tick, cfg, state, gi, gsm_unknown, on)
    # Offsets are learned only from GPUs doing what their peers do: not from one with its clocks cut (nor
    # from its full-clock peers meanwhile), nor from one idling well below its peers (a host-starved node)
    # - learned from those, the recovered GPU stood out in the culprit direction afterwards (an alert
    # that never cleared). Such a GPU is never warm either: a rank idling that much all along is judged
    # by the cross-section alone.
    idling = dev[_UTIL] <= -cfg.node_idle_gap
    _learn(state, cfg, dev, sm, busy & wait_util & ~cut & ~victim & ~idling, waiting, in_job)
    on &= ~_mixed_fallback(tick, eligible & weak & in_group, gi)
    out = Outcome()
    standout = set(g[eligible & weak].tolist())
    node_findings, node_standout, node_pairs = _node_level(tick, state, halted)
    # A node standing out as a whole explains its group's waiting: no GPU of that group is named.
    for gid, _ in node_standout:
        on &= g != gid
    whole_findings, whole_standout, whole_pairs, on = _whole_node(tick, state, on,
                                                                  (eligible | eligible_cross) & waiting & weak,
                                                                  idle[0])
    for slot in on.nonzero()[0].tolist():
        out.add(_gpu_finding(tick, state, slot, ex[:, slot], dev[:, slot], bool(cross[slot]), bool(idle[0, slot])))
    for f in node_findings + whole_findings:
        out.add(f)
    node_standout |= whole_standout
    node_pairs.update(whole_pairs)
    standout |= {gid for gid, _ in node_standout}
    judged = (busy | starved) & active
    warm = (state.learned[:n] >= warm_ticks) & measured
    out.clear = _clear_test(tick, index, judged, warm, waiting, weak, cross, node_pairs, node_standout)
    state.prune(tick.t)
    return Result(out, standout)


def _standing_now(tick: Tick, cfg, state: StragglerState, gi: np.ndarray, gsm_unknown: np.ndarray,
                  on: np.ndarray) -> np.ndarray:
    """Per slot: whether a GPU found standing out over the smoothing window still does in its newest
    readings (its newest bin, or the one before where that is empty), at the weaker margins; True where
    it has neither (no evidence against).

    The smoothing window's median lags by up to half its length. A GPU that recovered reads its normal
    level at once, while its peers' medians still hold their wait: it stood on against them for another
    15-30 s. Brief jitters back to back, each shorter than the for duration, fired so: one GPU slow twice
    (10 s sampling, and 5 s with 12 s between), and three GPUs slow in turn (1 s, the middle one named).
    A two-bin median still lagged enough to carry the 5 s case over its gap.
    """
    if not on.any():
        return on
    now = _newest(tick, _NOW_ROWS)
    if now is None:
        return np.ones_like(on)
    peers = tick.groups.members.layout.medians(now[:_UTIL + 1])[:, gi]
    dev = _deviation(now[:_UTIL + 1], peers)
    ex = dev - nan_to_zero(state.offset[:, :len(on)])
    weak = _SCALES[1, 0]
    standing = ((ex[_SM] >= weak * cfg.straggler_sm_excess)
                | (gsm_unknown & (ex[_PW] >= weak * cfg.straggler_power_excess))
                | (-ex[_CLK] >= weak * cfg.straggler_clock_deficit)
                | (-np.fmin(ex[_UTIL], dev[_UTIL]) >= weak * cfg.node_idle_gap)
                | (now[_UTIL + 1] >= 0.5))
    return standing | np.isnan(now[_UTIL])


def _deviation(levels: np.ndarray, peers: np.ndarray) -> np.ndarray:
    """Per slot, rows as groups.LEVELS: SM activity, power and clock as a ratio to the peers' less 1,
    utilization as the difference from the peers'."""
    dev = levels / peers - 1.0
    dev[_UTIL] = levels[_UTIL] - peers[_UTIL]
    return dev


def _node_activity(node_sm: np.ndarray, node_pw: np.ndarray, o_sm: np.ndarray,
                   o_pw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A node's activity relative to the other nodes' less 1: SM activity, or power where that is
    unsupported; and where power was used."""
    act_sm = node_sm / o_sm - 1.0
    by_power = np.isnan(act_sm)
    return np.where(by_power, node_pw / o_pw - 1.0, act_sm), by_power


def _newest(tick: Tick, rows: np.ndarray) -> np.ndarray | None:
    """Each slot's newest reading of some binned rows, shape (len(rows), n): its newest bin's mean, or
    the bin before's where the newest has no sample (every other bin at 10 s sampling); None before
    the tick holds two bins."""
    if len(tick.held) < 2:
        return None
    recent = tick.windows.recent(tick.k, 2, rows, tick.held[:2])            # (2, rows, n), newest first
    return np.where(tick.held[0], recent[0], recent[1])


def _group_conditions(tick: Tick, state: StragglerState, cfg, halted: set[int]) -> np.ndarray:
    """Per-group conditions of detect(), stacked (7, n_groups) so one gather maps them to slots: old
    and big enough to judge; steady long enough for the cross-section test; peers slowed against the
    baseline; peers spinning; group active; a job group; slowdown measured."""
    grp = tick.groups
    G = grp.n_groups
    big = grp.size >= cfg.straggler_min_group
    active = grp.util >= cfg.job_active_utilization
    aged = tick.t - tick.registry.first_seen[:G] >= cfg.startup_grace_seconds
    steady = tick.t - state.steady_since(tick, cfg) >= cfg.startup_grace_seconds / 2
    min_drop = np.where(tick.slowdown_source == 2, cfg.straggler_min_power_drop, cfg.straggler_min_slowdown)
    if halted:
        big[list(halted)] = False
    return np.array([aged & big & active, steady & big, tick.slowdown >= min_drop,
                     grp.util >= cfg.straggler_waiting_utilization, active, tick.registry.is_job[:G],
                     ~np.isnan(tick.slowdown)])


def _mixed_fallback(tick: Tick, standing: np.ndarray, gi: np.ndarray) -> np.ndarray:
    """Per slot: its group is an unattributed one (busy GPUs of one model on a node) where more than a
    quarter of the GPUs stand out at once.

    A straggler is one GPU, or a few, against many waiting peers. Without attribution a node's busy
    GPUs may be two jobs: when one of them slows, the other job's GPUs all "stand out" against the
    mixed median, each looking like a culprit. So many at once says the group is not one job, and
    nobody in it is named. A job group is exempt: there a brake on half a node is a real finding.
    """
    grp = tick.groups
    fallback = ~tick.registry.is_job[:grp.n_groups]
    if not fallback.any() or not standing.any():
        return np.zeros(len(gi), dtype=bool)
    counts = np.bincount(gi[standing], minlength=grp.n_groups)
    mixed = fallback & (counts > np.maximum(1, grp.size // 4))
    return mixed[gi] & (grp.gid >= 0)


def _reset_moved(state: StragglerState, g: np.ndarray) -> None:
    """A GPU that joined another group starts learning afresh."""
    moved = (g >= 0) & (g != state.learned_gid[:len(g)])
    if moved.any():
        state.forget(np.flatnonzero(moved))
        state.learned_gid[moved] = g[moved]


def _clock_cut(cfg, clk_dev: np.ndarray, slow: np.ndarray, peer_slow: np.ndarray) -> np.ndarray:
    """Clocks cut below the peers' by the clock margin (clk_dev: SM clock ratio against the peers', - 1),
    with slowdown bits (HW slowdown, power brake, thermal) that the peers do not have (either alone where
    the other is not reported). Per GPU against its group, or per node against the group's other nodes.

    In a synchronous job such a GPU is slower than its peers whatever else it reads, so this counts as
    the cross-sectional "peers wait for it" evidence with no baseline needed; without it a brake present
    from the job's start is never named where SM activity is unsupported (a braked GPU draws *less* power
    than its spinning peers). Nothing is learned from such a GPU: an offset learned while braked (power far
    below the peers') made the recovered GPU stand out afterwards, an alert that never cleared.
    """
    deficit = -clk_dev >= cfg.straggler_clock_deficit
    # A driver without SM clocks leaves the bits alone (as in _signals); one without throttle reasons,
    # the clock deficit alone.
    bits = (slow >= 0.5) & ~(peer_slow >= 0.25)
    return (bits & (deficit | np.isnan(clk_dev))) | (np.isnan(slow) & deficit)


def _cuts(tick: Tick, cfg, dev: np.ndarray, gslow: np.ndarray, gi: np.ndarray,
          in_group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: clocks cut (see _clock_cut), and "victim": a GPU without slowdown bits in a group where
    some GPU's clocks are cut, whose activity excess is spinning at full clocks, not work.

    Where a quarter or more of a group has slowdown bits, its median clock is no reference: a GPU with
    bits whose clock is 8 % below the median of the GPUs *without* bits is cut too (a power brake on half
    a node). dev[_CLK] of such a GPU is set against those GPUs, for its signals and its evidence.
    """
    slow = tick.med["slow"]
    cut = _clock_cut(cfg, dev[_CLK], slow, gslow)
    bits = slow >= 0.5
    grp = tick.groups
    if (bits & (gslow >= 0.25)).any():
        free_clock = grp.members.layout.medians(np.where(bits, np.nan, tick.levels[_CLK])[None, :])[0]
        dev_free = tick.levels[_CLK] / free_clock[gi] - 1.0
        # Where clocks are not reported, the bits alone, as long as the group has GPUs reporting none.
        free = np.bincount(gi[in_group & (slow < 0.5)], minlength=grp.n_groups) > 0
        more = bits & in_group & ((-dev_free >= cfg.straggler_clock_deficit)
                                  | (np.isnan(tick.levels[_CLK]) & free[gi]))
        dev[_CLK] = np.where(more, np.fmin(dev[_CLK], dev_free), dev[_CLK])
        cut |= more
    if not cut.any():
        return cut, cut
    cut_groups = np.bincount(gi[cut & in_group], minlength=grp.n_groups) > 0
    return cut, in_group & cut_groups[gi] & ~cut & ~bits


# detect() asks for every culprit signal at the configured margins and at 0.6 x them (weaker: enough
# to suppress workload alerts and to keep an open alert from clearing) in one pass.
_SCALES = np.array([[1.0], [0.6]])


def _signals(cfg, ex: np.ndarray, sm: np.ndarray, level_sm: np.ndarray, gsm_unknown: np.ndarray,
             slow: np.ndarray, gslow: np.ndarray) -> np.ndarray:
    """Culprit signals at each of _SCALES x the configured margins, shape (2, n) (NaN comparisons are False)."""
    stays_high = ~(sm < 0.85 * level_sm)
    sm_excess = (ex[_SM] >= _SCALES * cfg.straggler_sm_excess) & stays_high
    power_excess = gsm_unknown & (ex[_PW] >= _SCALES * cfg.straggler_power_excess)
    clock_deficit = -ex[_CLK] >= _SCALES * cfg.straggler_clock_deficit
    # Slowdown bits on one GPU and not its peers, confirmed by half a margin of a reading; where the
    # GPU reports no clocks (the reading that shows what the bits do), the bits stand alone.
    bits = ((slow >= 0.5) & ~(gslow >= 0.25)
            & (np.isnan(ex[_CLK]) | (-ex[_CLK] >= _SCALES * cfg.straggler_clock_deficit / 2)
               | (ex[_SM] >= _SCALES * cfg.straggler_sm_excess / 2)
               | (ex[_PW] >= _SCALES * cfg.straggler_power_excess / 2)))
    return sm_excess | power_excess | clock_deficit | bits


# Sign of the culprit direction of the SM, power and clock offsets (a culprit's clock is lower).
_CULPRIT_SIGN = np.array([[1.0], [1.0], [-1.0]])


def _learn(state: StragglerState, cfg, dev: np.ndarray, sm: np.ndarray, steady: np.ndarray,
           waiting: np.ndarray, in_job: np.ndarray) -> None:
    """Track each GPU's structural offset from its peers while its group runs steadily and unslowed.

    The first startup_grace_seconds of steady running learn fast (forgetting the ramp-up); after that
    the offsets follow slowly, and freeze while the group is slowed so a culprit is never absorbed.
    """
    n = len(steady)
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    warming = state.learned[:n] < warm_ticks
    learn = steady & (warming | ~waiting)
    alpha = np.where(warming, _FAST_ALPHA, 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds))
    state.offset = _follow(state.offset, dev, learn, alpha)
    # Peers in one job run the same steps: a GPU that looked like a culprit from the very start is not
    # "structural" (capped). An offset in the victim direction is not learned at all: it could only make
    # a GPU look more like a culprit, and it did once a node slow from the start recovered - the GPUs that
    # had waited for it then stood out. (Fallback groups may mix unrelated work: their offsets stay free.)
    cap = cfg.structural_max_offset
    culprit = state.offset[:_UTIL]
    state.offset[:_UTIL] = np.where(in_job, _CULPRIT_SIGN * np.clip(_CULPRIT_SIGN * culprit, 0.0, cap), culprit)
    state.level_sm = _follow(state.level_sm, sm, learn, alpha)
    state.learned[:n] += learn


def _follow(cur: np.ndarray, x: np.ndarray, learn: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Exponential moving average step where learning and x is known; the first value is taken as is."""
    ok = learn & ~np.isnan(x)
    return np.where(ok, np.where(np.isnan(cur), x, cur + alpha * (x - cur)), cur)


def _gpu_finding(tick: Tick, state: StragglerState, slot: int, ex: np.ndarray, dev: np.ndarray,
                 cross: bool = False, idle: bool = False) -> Finding:
    """Evidence, cost and wording for one culprit GPU (idle: it idles on its host while its peers wait)."""
    cfg = tick.config
    w, grp, m = tick.windows, tick.groups, tick.med
    gid = int(grp.gid[slot])
    job = tick.registry.job(gid)
    slowdown = float(tick.slowdown[gid])
    cut = m["slow"][slot] >= 0.5 and -dev[_CLK] > 0.0
    if cross:
        known = slowdown if slowdown == slowdown else 0.0
        if idle:
            # The peers spin for as long as it idles: its utilization gap is their share of each step.
            slowdown = max(known, float(-dev[_UTIL]))
        else:
            # Peers' activity relative to the culprit's: how much of each step they spend waiting.
            rel = ex[_SM] if not math.isnan(ex[_SM]) else ex[_PW]
            slowdown = max(known, 1.0 - 1.0 / (1.0 + max(rel, 0.0)))
        if cut:
            # A GPU at a fraction of its peers' clocks takes that much longer per step (compute-bound).
            slowdown = max(slowdown, float(-dev[_CLK]))
    size = int(grp.size[gid])
    reasons = []
    if ex[_SM] >= cfg.straggler_sm_excess:
        reasons.append(f"SM activity {m['sm'][slot]:.2f} vs peers {grp.sm[gid]:.2f}")
    if -ex[_CLK] >= cfg.straggler_clock_deficit:
        reasons.append(f"SM clock {m['clock'][slot] * 100:.0f} % of max vs peers {grp.clock[gid] * 100:.0f} %")
    if math.isnan(grp.sm[gid]) and ex[_PW] >= cfg.straggler_power_excess:
        reasons.append(f"power {m['power'][slot]:.0f} W vs peers {grp.power[gid]:.0f} W")
    if m["slow"][slot] >= 0.5:
        reasons.append("throttle/slowdown bits set")
    if idle:
        reasons.append(f"utilization {m['util'][slot]:.2f} vs peers {grp.util[gid]:.2f}: idle, waiting on its host")
    fp = subject_fingerprint(AlertKind.STRAGGLER, w.slot_node[slot], w.slot_index[slot], job)
    lost = state.add_cost(fp, tick.t, max(slowdown, 0.0) * size * cfg.tick_seconds / 3600.0)
    evidence = {
        "peer_group": tick.registry.kind(gid), "peer_group_size": size,
        "sm_active_ratio": r3(m["sm"][slot]), "peer_median_sm_active_ratio": r3(grp.sm[gid]),
        "sm_clock_ratio": r3(m["clock"][slot]), "peer_median_sm_clock_ratio": r3(grp.clock[gid]),
        "power_watts": r3(m["power"][slot]), "peer_median_power_watts": r3(grp.power[gid]),
        "utilization_ratio": r3(m["util"][slot]), "peer_median_utilization_ratio": r3(grp.util[gid]),
        "slow_throttle_bits_share": r3(m["slow"][slot]),
        "excess_vs_own_baseline": {"sm_active": r3(ex[_SM]), "power": r3(ex[_PW]), "sm_clock": r3(ex[_CLK]),
                                   "utilization": r3(ex[_UTIL])},
        "pattern": "host_idle" if idle else "gpu_clocks_cut" if cut else "gpu_slow",
        "estimated_job_slowdown_ratio": r3(slowdown),
        "slowdown_measured_by": "sm_active" if tick.slowdown_source[gid] == 1 else "power",
        "gpu_hours_lost": round(lost, 4),
    }
    if tick.registry.kind(gid) != JOB:
        evidence["note"] = "no hpc_job attribution: compared with busy GPUs of the same model on this node"
    sev = Severity.CRITICAL if slowdown >= 0.2 else Severity.WARNING
    summary = (f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} holds back "
               f"{'job ' + job if job else 'its peers'} (~{slowdown * 100:.0f} % slower): " + "; ".join(reasons))
    return Finding(AlertKind.STRAGGLER, w.slot_node[slot], w.slot_index[slot], w.slot_uuid[slot], job, sev,
                   summary, evidence)


def _whole_node(tick: Tick, state: StragglerState, on: np.ndarray, weak: np.ndarray, idle: np.ndarray):
    """Most GPUs of one node standing out together: the node is the culprit (gpu null), not each GPU
    (idle: per slot, standing out by idling on its host; most of the node's named GPUs so: host-bound)."""
    w, grp = tick.windows, tick.groups
    g = grp.gid
    members = (g >= 0) & ~np.isnan(tick.med["util"])
    if not on.any():
        return [], set(), {}, on
    n_nodes = len(w.node_names)
    key = np.where(members, g * n_nodes + w.slot_node_id[:w.n], -1)
    uniq, inv = np.unique(key[members], return_inverse=True)
    n_pairs = len(uniq)
    size = np.bincount(inv, minlength=n_pairs)
    n_on = np.bincount(inv, weights=on[members], minlength=n_pairs)
    n_weak = np.bincount(inv, weights=weak[members], minlength=n_pairs)
    pair_group = uniq // n_nodes
    spans = np.bincount(pair_group, minlength=grp.n_groups)[pair_group] >= 2
    whole = spans & (n_on >= 2) & (n_weak >= 0.5 * size)
    stands = spans & (n_weak >= 2) & (n_weak >= 0.5 * size)
    findings, standout, pairs = [], set(), {}
    on = on.copy()
    member_slots = np.flatnonzero(members)
    for p in stands.nonzero()[0].tolist():
        gid, nid = int(uniq[p] // n_nodes), int(uniq[p] % n_nodes)
        standout.add((gid, nid))
        pairs[state.node_fingerprint(tick, gid, nid)] = (gid, nid)
    for p in whole.nonzero()[0].tolist():
        gid, nid = int(uniq[p] // n_nodes), int(uniq[p] % n_nodes)
        slots = member_slots[inv == p]
        others = member_slots[(pair_group[inv] == gid) & (inv != p)]
        named = slots[on[slots]]
        pattern = "idle" if 2 * np.count_nonzero(idle[named]) > len(named) else "busy"
        on[slots] = False
        findings.append(_slow_node_finding(tick, state, gid, nid, slots, others, pattern=pattern))
    return findings, standout, pairs, on


def _slow_node_finding(tick: Tick, state: StragglerState, gid: int, nid: int, slots: np.ndarray,
                       others: np.ndarray, slowdown: float | None = None, pattern: str = "busy") -> Finding:
    """Evidence for a node holding its group back: its GPUs busy (or idle) while the other nodes wait."""
    cfg = tick.config
    node = tick.windows.node_names[nid]
    job = tick.registry.job(gid)
    slowdown = float(tick.slowdown[gid]) if slowdown is None else float(slowdown)
    known = slowdown == slowdown        # NaN: the job has no baseline yet (a node slow from its start)
    size = int(tick.groups.size[gid])
    fp = subject_fingerprint(AlertKind.STRAGGLER, node, None, job)
    lost = state.add_cost(fp, tick.t, (max(slowdown, 0.0) if known else 0.0) * size * cfg.tick_seconds / 3600.0)

    # Medians over the node's GPUs and over the other nodes' GPUs, rows as tick.levels (None: unknown).
    node_sm, node_pw, node_clk, node_u = map(r3, nan_median_first_axis(tick.levels[:, slots].T).tolist())
    rest_sm, rest_pw, rest_clk, rest_u = map(r3, nan_median_first_axis(tick.levels[:, others].T).tolist())
    evidence = {
        "peer_group": tick.registry.kind(gid), "peer_group_size": size, "node_gpus": int(len(slots)),
        "node_median_sm_active_ratio": node_sm, "other_nodes_sm_active_ratio": rest_sm,
        "node_median_sm_clock_ratio": node_clk, "other_nodes_sm_clock_ratio": rest_clk,
        "node_median_power_watts": node_pw, "other_nodes_power_watts": rest_pw,
        "node_median_utilization_ratio": node_u, "other_nodes_utilization_ratio": rest_u,
        "estimated_job_slowdown_ratio": r3(slowdown), "gpu_hours_lost": round(lost, 4),
    }
    if pattern == "idle":
        what = (f"its GPUs idle (utilization {evidence['node_median_utilization_ratio']} vs "
                f"{evidence['other_nodes_utilization_ratio']}), host-bound")
    elif pattern == "cut":
        what = (f"its GPUs' clocks are cut, with throttle bits the other nodes lack (SM clock {_pct(node_clk)} "
                f"of max vs {_pct(rest_clk)})")
    else:
        what = "its GPUs stay busy"
    evidence["pattern"] = {"idle": "host_idle", "cut": "node_clocks_cut"}.get(pattern, "node_slow")
    if tick.registry.kind(gid) != JOB:
        evidence["note"] = "no hpc_job attribution: compared with unattributed nodes of the same GPU model"
    summary = (f"node {node} holds back {'job ' + job if job else 'its peer nodes'}: {what} while "
               f"the other nodes wait" + (f" (~{slowdown * 100:.0f} % slower)" if known else ""))
    sev = Severity.CRITICAL if slowdown >= 0.2 else Severity.WARNING
    return Finding(AlertKind.STRAGGLER, node, None, None, job, sev, summary, evidence)


def _pct(ratio: float | None) -> str:
    """A ratio as a whole percentage for a summary ('?' when unknown)."""
    return "?" if ratio is None else f"{ratio * 100:.0f} %"


def _node_level(tick: Tick, state: StragglerState,
                halted: set[int] = frozenset()) -> tuple[list[Finding], set[tuple[int, int]], dict]:
    """Nodes holding their group back while the other nodes wait in collectives: their GPUs idle (host-
    bound), busier than the others' (slow), or with their clocks cut."""
    cfg = tick.config
    w, grp, m = tick.windows, tick.groups, tick.med
    ng = grp.ngid
    u = m["util"]
    sel = (ng >= 0) & ~np.isnan(u)
    if not sel.any():
        return [], set(), {}
    node_id = w.slot_node_id[:w.n]
    lay = state.node_pairs(tick, ng, sel, node_id)
    if lay is None:
        return [], set(), {}
    gids, nids, idx = lay.gids, lay.nids, lay.idx
    # Per (group, node) pair: rows as tick.levels, then the share of bins with slowdown or power-cap bits.
    # A cap on one node's GPUs (a rack or PDU limit) slows the job like a brake does; one on every node
    # (the operator's uniform cap) sets nobody apart.
    bits = np.fmax(m["slow"], m["power_cap"])
    nodes = lay.members.medians(np.concatenate([tick.levels, bits[None, :]]))
    node_sm, node_pw, node_clk, node_u, node_slow = nodes[:, lay.sel_pairs]
    o_sm, o_pw, o_clk, o_u, o_slow = _others(nodes, lay)[:, lay.sel_pairs]
    base_sm, base_pw = tick.slowdown_baselines
    drop_sm = 1.0 - o_sm / base_sm[gids]
    drop_pw = np.where(base_pw[gids] > 0, 1.0 - o_pw / base_pw[gids], np.nan)
    waiting_drop = np.where(np.isnan(drop_sm), drop_pw, drop_sm)
    min_drop = np.where(np.isnan(drop_sm), cfg.straggler_min_power_drop, cfg.straggler_min_slowdown)
    gap = o_u - node_u
    steady = o_u >= cfg.straggler_waiting_utilization
    act, by_power = _node_activity(node_sm, node_pw, o_sm, o_pw)
    act_margin = np.where(by_power, cfg.node_power_excess, cfg.straggler_sm_excess)
    # A node whose clocks are cut below the others', with slowdown bits they lack (a node-wide power brake,
    # HW slowdown), is slower whatever its activity says; as for a GPU (_clock_cut), no baseline needed.
    # The others then draw more power spinning at full clocks: that is not "busy while the others wait".
    clk_dev = node_clk / o_clk - 1.0
    cut = _clock_cut(cfg, clk_dev, node_slow, o_slow)
    others_cut = _clock_cut(cfg, -clk_dev, o_slow, node_slow)       # -clk_dev: near enough for a margin
    # "Busy while the others wait" needs the others spinning at least as much as this node; others
    # that idle more than it are starved themselves (that is the host-idle pattern, on them).
    node_busy = (node_u >= cfg.busy_utilization) & ~(gap < -cfg.node_idle_gap / 2) & ~others_cut
    # Without a baseline (a node idle or slow from the job's start) nothing has dropped. In one job every
    # node runs the same steps, so others spinning at high utilization while this node idles far more,
    # or is far more active, are waiting for it: twice the margins, as for a GPU (see detect()).
    prev = nan_to_zero(state.pair_offset[:, idx])
    cross = tick.registry.is_job[gids] & steady & (
        (gap - prev[0] >= 2 * cfg.node_idle_gap) | (node_busy & (act - prev[1] >= 2 * act_margin)))
    aged = tick.t - tick.registry.first_seen[gids] >= cfg.startup_grace_seconds
    cut &= tick.registry.is_job[gids] & steady & aged
    waiting = ((waiting_drop >= min_drop) & steady) | cross | cut
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    n_learned = state.pair_learned[idx]
    warming = n_learned < warm_ticks
    learn = steady & (warming | ~waiting) & ~np.isnan(gap) & ~cut & ~others_cut
    alpha = np.where(warming, _FAST_ALPHA, 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds))
    off = _follow(state.pair_offset[:, idx], np.array([gap, act]), learn, alpha)
    # Nodes of one job run the same steps: as for GPUs (see _learn), an offset in the culprit direction is
    # capped, and none is learned in the victim direction: a node learned while it idled (host-starved
    # from the start) read as "busier" than the others once it recovered.
    cap = cfg.structural_max_offset
    off = state.pair_offset[:, idx] = np.where(tick.registry.is_job[gids], np.clip(off, 0.0, cap), off)
    state.pair_learned[idx] = n_learned + learn
    ready = ~warming & ~np.isnan(off[0]) & aged
    idle = gap - off[0]
    # Unattributed nodes are not known to run one job: a node "busier while the others wait" may just run
    # another job than the nodes whose job slowed (comm- or input-bound). It is judged only where its
    # activity matched the others' while healthy (learned offset within structural_max_offset), as the
    # nodes of one job do; two jobs that happen to run alike cannot be told apart.
    alike = tick.registry.is_job[gids] | (np.abs(off[1]) <= cap)
    busier = np.where(node_busy & alike, act - nan_to_zero(off[1]), np.nan)
    score = np.fmax(idle / cfg.node_idle_gap, busier / act_margin)
    stands = (ready & waiting & (score >= 0.6)) | cut
    on = ready & waiting & (score >= 1.0)
    if on.any():
        # As for a GPU (_standing_now): named only while its newest reading still sets it apart.
        now = _pair_score_now(tick, lay, off, node_busy & alike, act_margin)
        on &= ~(now < 0.6)
    on |= cut
    if halted:
        live = ~np.isin(gids, list(halted))
        stands &= live
        on &= live
    pairs = dict(lay.pairs)
    standout = {(int(gids[i]), int(nids[i])) for i in stands.nonzero()[0].tolist()}
    findings = []
    for i in on.nonzero()[0].tolist():
        gid, nid = int(gids[i]), int(nids[i])
        members = np.flatnonzero((ng == gid) & (node_id == nid) & ~np.isnan(u))
        rest = np.flatnonzero((ng == gid) & (node_id != nid) & ~np.isnan(u))
        idle_score, busy_score = idle[i] / cfg.node_idle_gap, busier[i] / act_margin[i]
        # NaN busy score: not judged (unattributed) or unknown; then what fired is the idle gap.
        pattern = ("cut" if cut[i] else "busy" if busy_score == busy_score and not idle_score >= busy_score
                   else "idle")
        if pattern == "busy" and not tick.registry.is_job[gid] and not _node_wide_busy(tick, members, rest,
                                                                                     float(act_margin[i])):
            continue
        slowdown = waiting_drop[i] if waiting_drop[i] == waiting_drop[i] else 0.0
        if pattern == "cut" and clk_dev[i] < 0.0:
            # At a fraction of the others' clocks each step takes that much longer (compute-bound).
            slowdown = max(slowdown, float(-clk_dev[i]))
        elif cross[i]:
            # The others' share of each step spent waiting: the idle gap, or their activity against this node's.
            slowdown = max(slowdown, gap[i] if pattern == "idle" else 1.0 - 1.0 / (1.0 + max(float(act[i]), 0.0)))
        findings.append(_slow_node_finding(tick, state, gid, nid, members, rest, slowdown, pattern))
    return findings, standout, pairs


def _pair_score_now(tick: Tick, lay: "_NodePairs", off: np.ndarray, judged_busy: np.ndarray,
                    act_margin: np.ndarray) -> np.ndarray:
    """Per (group, node) pair: _node_level's score (idle gap or activity excess over the learned offsets,
    in margins) on the newest readings (see _standing_now); NaN where the node has none."""
    cfg = tick.config
    now = _newest(tick, _NOW_ROWS[:_UTIL + 1])
    if now is None:
        return np.full(len(judged_busy), np.nan)
    nodes = lay.members.medians(now)
    node_sm, node_pw, _, node_u = nodes[:, lay.sel_pairs]
    o_sm, o_pw, _, o_u = _others(nodes, lay)[:, lay.sel_pairs]
    act, _ = _node_activity(node_sm, node_pw, o_sm, o_pw)
    idle = (o_u - node_u - off[0]) / cfg.node_idle_gap
    busier = np.where(judged_busy, act - nan_to_zero(off[1]), np.nan) / act_margin
    return np.fmax(idle, busier)


def _node_wide_busy(tick: Tick, members: np.ndarray, rest: np.ndarray, act_margin: float) -> bool:
    """Whether at least half of an unattributed node's GPUs are busier than the other nodes' GPUs on their
    own, rank for rank (the node's k-th lowest activity against the others' matching quantile), each by
    the whole node margin (half of it let GPU-to-GPU noise in power pass at random ranks).

    Unattributed nodes are compared over all their GPUs, which may run two jobs: then each node's
    readings are two clusters, its median falls between them, and one slow GPU moves it across the node
    margin. Compared rank for rank, that node differs at one rank; a slow node at most of them.
    """
    row = _SM if not np.isnan(tick.levels[_SM, members]).all() else _PW
    mine, theirs = np.sort(tick.levels[row, members]), tick.levels[row, rest]
    ok = ~np.isnan(mine)
    if not ok.any() or np.isnan(theirs).all():
        return False
    q = (np.arange(len(mine)) + 0.5) / len(mine)
    busier = mine[ok] / np.nanquantile(theirs, q[ok]) - 1.0 >= act_margin
    return 2 * int(np.count_nonzero(busier)) >= len(mine)


def _others(x: np.ndarray, lay: "_NodePairs") -> np.ndarray:
    """For each (group, node) pair, the typical value of the group's *other* nodes (exact for two
    nodes); x is (k, n_pairs), one row per reading, so every reading shares one grouped sort."""
    k = len(x)
    pair_group, n_groups = lay.pair_group, lay.n_groups
    known = ~np.isnan(x)
    filled = np.where(known, x, 0.0)
    ids = (pair_group + np.arange(k)[:, None] * n_groups).ravel()
    total = np.bincount(ids, weights=filled.ravel(), minlength=k * n_groups).reshape(k, n_groups)[:, pair_group]
    count = np.bincount(ids, weights=known.ravel(), minlength=k * n_groups).reshape(k, n_groups)[:, pair_group]
    # The other node's value, or NaN where it has none (an unsupported reading is absent, never 0).
    other = np.where(count > known, total - filled, np.nan)
    if not lay.three_or_more:
        return other                        # the only pairs that count are in groups of two nodes
    two = lay.per_group[pair_group] == 2
    return np.where(two, other, lay.nodes_of_group.medians(x)[:, pair_group])


def _clear_test(tick: Tick, index: FingerprintIndex, judged: np.ndarray, warm: np.ndarray, waiting: np.ndarray,
                weak: np.ndarray, cross: np.ndarray, node_pairs: dict[str, tuple[int, int]], node_standout: set[tuple[int, int]]):
    """Clear once the GPU no longer stands out even at reduced margins, its group stopped waiting or
    went idle, or it left the job.

    Before the group has a baseline (a straggler from the job's start keeps one from forming, since
    its open alert keeps the group's history from learning) only the cross-section can clear it: the
    GPU no longer stands out from its peers. Without that it would never resolve.
    """
    w = tick.windows

    def test(fp: str) -> bool | None:
        pair = node_pairs.get(fp)
        if pair is not None:
            return pair not in node_standout
        hit = index.get(w, fp)
        if hit is None:
            return None
        slot, code = hit
        if w.slot_job[slot] != code:
            return True
        if np.isnan(tick.med["util"][slot]):
            return None
        if not judged[slot]:
            return True
        if not warm[slot]:
            return not (weak[slot] or cross[slot])
        return not (waiting[slot] and weak[slot])

    return test
