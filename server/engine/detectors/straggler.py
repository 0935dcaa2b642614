"""straggler: the GPU (or node) that holds its peer group back, never the peers waiting for it.

Physics: in synchronous training one slow participant makes everyone else wait in collectives. The
waiting peers keep utilization high but lose SM activity and power against the group's own baseline;
the culprit stays busy (its SM activity stays high relative to the peers), or runs lower clocks, or
shows throttle / power-brake / HW-slowdown bits. A host-bound node shows its GPUs idle (utilization
low) while the rest of the job waits.

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
from server.engine.groups import JOB, group_medians
from server.engine.tick import Tick

_SM, _PW, _CLK, _UTIL = range(4)
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
        with np.errstate(invalid="ignore"):
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
                and np.array_equal(lay.ng, ng) and np.array_equal(lay.sel, sel)):
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
        self.pairs = {state.pair_fps[i]: (int(gg), int(nn))
                      for i, gg, nn in zip(self.idx.tolist(), self.gids.tolist(), self.nids.tolist())}


class Result:
    """Straggler outcome plus which groups have someone standing out (suppresses comm/input-bound)."""

    def __init__(self, outcome: Outcome, standout_groups: set[int]) -> None:
        self.outcome = outcome
        self.standout_groups = standout_groups


def detect(tick: Tick, state: StragglerState, index: FingerprintIndex) -> Result:
    """GPU-level and node-level straggler findings for this tick."""
    cfg = tick.config
    n = tick.windows.n
    state.fit(n)
    if tick.groups.n_groups == 0:
        return Result(Outcome(), set())
    g = tick.groups.gid
    _reset_moved(state, g)
    m = tick.med
    u, sm, pw, clk = m["util"], m["sm"], m["power"], m["clock"]
    gi = np.where(g >= 0, g, 0)
    grp = tick.groups
    gu, gsm, gpw, gclk = grp.util[gi], grp.sm[gi], grp.power[gi], grp.clock[gi]
    with np.errstate(invalid="ignore", divide="ignore"):
        dev = np.stack([sm / gsm - 1.0, pw / gpw - 1.0, clk / gclk - 1.0, u - gu])
        busy = (u >= cfg.busy_utilization) & (g >= 0)
        warm_ticks = cfg.bins(cfg.startup_grace_seconds)
        group_age = tick.t - tick.registry.first_seen[gi]
        slowdown = tick.slowdown[gi]
        eligible = (busy & (state.learned[:n] >= warm_ticks) & (group_age >= cfg.startup_grace_seconds)
                    & (grp.size[gi] >= cfg.straggler_min_group) & (gu >= cfg.job_active_utilization))
        min_drop = np.where(tick.slowdown_source[gi] == 2, cfg.straggler_min_power_drop, cfg.straggler_min_slowdown)
        ex = dev - np.nan_to_num(state.offset, nan=0.0)
        # Peers at high utilization far below one GPU's activity are spinning, i.e. waiting for it,
        # even when the job never had a healthy baseline (a straggler from the start).
        plain = np.where(np.isnan(gsm), ex[_PW] / cfg.straggler_power_excess,
                         ex[_SM] / (2 * cfg.straggler_sm_excess))
        cross = tick.registry.is_job[gi] & (g >= 0) & (plain >= 1.0)
        steady_for = tick.t - state.steady_since(tick, cfg)[gi]
        eligible_cross = (busy & cross & (steady_for >= cfg.startup_grace_seconds / 2)
                          & (grp.size[gi] >= cfg.straggler_min_group))
        waiting = ((slowdown >= min_drop) | cross) & (gu >= cfg.straggler_waiting_utilization)
        sig = _signals(cfg, ex, sm, state.level_sm, gsm, m["slow"], grp.slow[gi], 1.0)
        weak = _signals(cfg, ex, sm, state.level_sm, gsm, m["slow"], grp.slow[gi], 0.6)
    on = (eligible | eligible_cross) & waiting & sig
    _learn(state, cfg, dev, sm, busy, waiting, gu, tick.registry.is_job[gi] & (g >= 0))
    out = Outcome()
    standout = set(np.unique(g[eligible & weak]).tolist())
    node_findings, node_standout, node_pairs = _node_level(tick, state)
    # A node standing out as a whole explains its group's waiting: no GPU of that group is named.
    for gid, _ in node_standout:
        on &= g != gid
    whole_findings, whole_standout, whole_pairs, on = _whole_node(tick, state, on, eligible & waiting & weak)
    for slot in np.flatnonzero(on).tolist():
        out.add(_gpu_finding(tick, state, slot, ex[:, slot], dev[:, slot], bool(cross[slot])))
    for f in node_findings + whole_findings:
        out.add(f)
    node_standout |= whole_standout
    node_pairs.update(whole_pairs)
    standout |= {gid for gid, _ in node_standout}
    judged = busy & (gu >= cfg.job_active_utilization)
    warm = (state.learned[:n] >= warm_ticks) & ~np.isnan(slowdown)
    out.clear = _clear_test(tick, index, judged, warm, waiting, weak, cross, node_pairs, node_standout)
    state.prune(tick.t)
    return Result(out, standout)


def _reset_moved(state: StragglerState, g: np.ndarray) -> None:
    """A GPU that joined another group starts learning afresh."""
    moved = (g >= 0) & (g != state.learned_gid[:len(g)])
    if moved.any():
        state.offset[:, moved] = np.nan
        state.level_sm[moved] = np.nan
        state.learned[moved] = 0
        state.learned_gid[moved] = g[moved]


def _signals(cfg, ex: np.ndarray, sm: np.ndarray, level_sm: np.ndarray, gsm: np.ndarray, slow: np.ndarray,
             gslow: np.ndarray, scale: float) -> np.ndarray:
    """Culprit signals at `scale` x the configured margins (NaN comparisons are False)."""
    stays_high = ~(sm < 0.85 * level_sm)
    sm_excess = (ex[_SM] >= scale * cfg.straggler_sm_excess) & stays_high
    power_excess = np.isnan(gsm) & (ex[_PW] >= scale * cfg.straggler_power_excess)
    clock_deficit = -ex[_CLK] >= scale * cfg.straggler_clock_deficit
    bits = ((slow >= 0.5) & ~(gslow >= 0.25)
            & ((-ex[_CLK] >= scale * cfg.straggler_clock_deficit / 2)
               | (ex[_SM] >= scale * cfg.straggler_sm_excess / 2)
               | (ex[_PW] >= scale * cfg.straggler_power_excess / 2)))
    return sm_excess | power_excess | clock_deficit | bits


def _learn(state: StragglerState, cfg, dev: np.ndarray, sm: np.ndarray, busy: np.ndarray,
           waiting: np.ndarray, gu: np.ndarray, in_job: np.ndarray) -> None:
    """Track each GPU's structural offset from its peers while its group runs steadily and unslowed.

    The first startup_grace_seconds of steady running learn fast (forgetting the ramp-up); after that
    the offsets follow slowly, and freeze while the group is slowed so a culprit is never absorbed.
    """
    n = len(busy)
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    steady = busy & (gu >= cfg.straggler_waiting_utilization)
    warming = state.learned[:n] < warm_ticks
    learn = steady & (warming | ~waiting)
    alpha = np.where(warming, _FAST_ALPHA, 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds))
    for i in range(4):
        x = dev[i]
        ok = learn & ~np.isnan(x)
        cur = state.offset[i]
        cur[ok] = np.where(np.isnan(cur[ok]), x[ok], cur[ok] + alpha[ok] * (x[ok] - cur[ok]))
    # Peers in one job run the same steps: a GPU that looked like a culprit from the very start is not
    # "structural". (Fallback groups may mix unrelated work, so their offsets stay free.)
    cap = cfg.structural_max_offset
    for i, sign in ((_SM, 1.0), (_PW, 1.0), (_CLK, -1.0)):
        row = state.offset[i]
        over = in_job & (sign * row > cap)
        row[over] = sign * cap
    ok = learn & ~np.isnan(sm)
    lv = state.level_sm
    lv[ok] = np.where(np.isnan(lv[ok]), sm[ok], lv[ok] + alpha[ok] * (sm[ok] - lv[ok]))
    state.learned[:n] += learn


def _gpu_finding(tick: Tick, state: StragglerState, slot: int, ex: np.ndarray, dev: np.ndarray,
                 cross: bool = False) -> Finding:
    """Evidence, cost and wording for one culprit GPU."""
    cfg = tick.config
    w, grp, m = tick.windows, tick.groups, tick.med
    gid = int(grp.gid[slot])
    job = tick.registry.job(gid)
    slowdown = float(tick.slowdown[gid])
    if cross:
        # Peers' activity relative to the culprit's: how much of each step they spend waiting.
        rel = ex[_SM] if not math.isnan(ex[_SM]) else ex[_PW]
        slowdown = max(slowdown if slowdown == slowdown else 0.0, 1.0 - 1.0 / (1.0 + max(rel, 0.0)))
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
    fp = subject_fingerprint(AlertKind.STRAGGLER, w.slot_node[slot], w.slot_index[slot], job)
    lost = state.add_cost(fp, tick.t, max(slowdown, 0.0) * size * cfg.tick_seconds / 3600.0)
    evidence = {
        "peer_group": tick.registry.kind(gid), "peer_group_size": size,
        "sm_active_ratio": r3(m["sm"][slot]), "peer_median_sm_active_ratio": r3(grp.sm[gid]),
        "sm_clock_ratio": r3(m["clock"][slot]), "peer_median_sm_clock_ratio": r3(grp.clock[gid]),
        "power_watts": r3(m["power"][slot]), "peer_median_power_watts": r3(grp.power[gid]),
        "utilization_ratio": r3(m["util"][slot]), "peer_median_utilization_ratio": r3(grp.util[gid]),
        "slow_throttle_bits_share": r3(m["slow"][slot]),
        "excess_vs_own_baseline": {"sm_active": r3(ex[_SM]), "power": r3(ex[_PW]), "sm_clock": r3(ex[_CLK])},
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


def _whole_node(tick: Tick, state: StragglerState, on: np.ndarray, weak: np.ndarray):
    """Most GPUs of one node standing out together: the node is the culprit (gpu null), not each GPU."""
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
    for p in np.flatnonzero(stands).tolist():
        gid, nid = int(uniq[p] // n_nodes), int(uniq[p] % n_nodes)
        standout.add((gid, nid))
        pairs[state.node_fingerprint(tick, gid, nid)] = (gid, nid)
    for p in np.flatnonzero(whole).tolist():
        gid, nid = int(uniq[p] // n_nodes), int(uniq[p] % n_nodes)
        slots = member_slots[inv == p]
        on[slots] = False
        others = member_slots[(pair_group[inv] == gid) & (inv != p)]
        findings.append(_slow_node_finding(tick, state, gid, nid, slots, others))
    return findings, standout, pairs, on


def _slow_node_finding(tick: Tick, state: StragglerState, gid: int, nid: int, slots: np.ndarray,
                       others: np.ndarray, slowdown: float | None = None, pattern: str = "busy") -> Finding:
    """Evidence for a node holding its group back: its GPUs busy (or idle) while the other nodes wait."""
    cfg = tick.config
    m = tick.med
    node = tick.windows.node_names[nid]
    job = tick.registry.job(gid)
    slowdown = float(tick.slowdown[gid]) if slowdown is None else float(slowdown)
    size = int(tick.groups.size[gid])
    fp = subject_fingerprint(AlertKind.STRAGGLER, node, None, job)
    lost = state.add_cost(fp, tick.t, max(slowdown, 0.0) * size * cfg.tick_seconds / 3600.0)

    def med(name: str, idx: np.ndarray) -> float | None:
        x = m[name][idx]
        x = x[~np.isnan(x)]
        return r3(np.median(x)) if len(x) else None

    evidence = {
        "peer_group": tick.registry.kind(gid), "peer_group_size": size, "node_gpus": int(len(slots)),
        "node_median_sm_active_ratio": med("sm", slots), "other_nodes_sm_active_ratio": med("sm", others),
        "node_median_sm_clock_ratio": med("clock", slots), "other_nodes_sm_clock_ratio": med("clock", others),
        "node_median_power_watts": med("power", slots), "other_nodes_power_watts": med("power", others),
        "node_median_utilization_ratio": med("util", slots), "other_nodes_utilization_ratio": med("util", others),
        "estimated_job_slowdown_ratio": r3(slowdown), "gpu_hours_lost": round(lost, 4),
    }
    if pattern == "idle":
        what = (f"its GPUs idle (utilization {evidence['node_median_utilization_ratio']} vs "
                f"{evidence['other_nodes_utilization_ratio']}), host-bound")
    else:
        what = "its GPUs stay busy"
    evidence["pattern"] = "host_idle" if pattern == "idle" else "node_slow"
    if tick.registry.kind(gid) != JOB:
        evidence["note"] = "no hpc_job attribution: compared with unattributed nodes of the same GPU model"
    summary = (f"node {node} holds back {'job ' + job if job else 'its peer nodes'}: {what} while "
               f"the other nodes wait (~{slowdown * 100:.0f} % slower)")
    sev = Severity.CRITICAL if slowdown >= 0.2 else Severity.WARNING
    return Finding(AlertKind.STRAGGLER, node, None, None, job, sev, summary, evidence)


def _node_level(tick: Tick, state: StragglerState) -> tuple[list[Finding], set[tuple[int, int]], dict]:
    """Nodes whose GPUs went idle while the rest of their group waits in collectives."""
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
    pair_group, per_group, sel_pairs, gids, nids, idx = (lay.pair_group, lay.per_group, lay.sel_pairs, lay.gids,
                                                         lay.nids, lay.idx)
    node_u, node_sm, node_pw = nodes = group_medians(np.stack([u[sel], m["sm"][sel], m["power"][sel]]), lay.inv,
                                                     len(pair_group))
    others = _others(nodes, pair_group, per_group, grp.n_groups)
    base_sm, base_pw = tick.slowdown_baselines
    o_u, o_sm, o_pw = (o[sel_pairs] for o in others)
    with np.errstate(invalid="ignore", divide="ignore"):
        drop_sm = 1.0 - o_sm / base_sm[gids]
        drop_pw = np.where(base_pw[gids] > 0, 1.0 - o_pw / base_pw[gids], np.nan)
        waiting_drop = np.where(np.isnan(drop_sm), drop_pw, drop_sm)
        min_drop = np.where(np.isnan(drop_sm), cfg.straggler_min_power_drop, cfg.straggler_min_slowdown)
        gap = o_u - node_u[sel_pairs]
        steady = o_u >= cfg.straggler_waiting_utilization
        waiting = (waiting_drop >= min_drop) & steady
        # Activity of this node relative to the others: SM activity, or power where unsupported.
        act_sm = node_sm[sel_pairs] / o_sm - 1.0
        act = np.where(np.isnan(act_sm), node_pw[sel_pairs] / o_pw - 1.0, act_sm)
        act_margin = np.where(np.isnan(act_sm), cfg.node_power_excess, cfg.straggler_sm_excess)
        # "Busy while the others wait" needs the others spinning at least as much as this node; others
        # that idle more than it are starved themselves (that is the host-idle pattern, on them).
        node_busy = (node_u[sel_pairs] >= cfg.busy_utilization) & ~(gap < -cfg.node_idle_gap / 2)
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    off, n_learned = state.pair_offset[:, idx], state.pair_learned[idx]
    warming = n_learned < warm_ticks
    learn = steady & (warming | ~waiting) & ~np.isnan(gap)
    alpha = np.where(warming, _FAST_ALPHA, 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds))
    for row, x in ((0, gap), (1, act)):
        ok = learn & ~np.isnan(x)
        off[row] = np.where(ok, np.where(np.isnan(off[row]), x, off[row] + alpha * (x - off[row])), off[row])
    state.pair_offset[:, idx] = off
    state.pair_learned[idx] = n_learned + learn
    with np.errstate(invalid="ignore"):
        ready = ~warming & ~np.isnan(off[0]) & (tick.t - tick.registry.first_seen[gids] >= cfg.startup_grace_seconds)
        idle = gap - off[0]
        busier = np.where(node_busy, act - np.nan_to_num(off[1]), np.nan)
        score = np.fmax(idle / cfg.node_idle_gap, busier / act_margin)
        stands = ready & waiting & (score >= 0.6)
        on = ready & waiting & (score >= 1.0)
    pairs = dict(lay.pairs)
    standout = {(int(gids[i]), int(nids[i])) for i in np.flatnonzero(stands).tolist()}
    findings = []
    for i in np.flatnonzero(on).tolist():
        gid, nid = int(gids[i]), int(nids[i])
        members = np.flatnonzero((ng == gid) & (node_id == nid) & ~np.isnan(u))
        rest = np.flatnonzero((ng == gid) & (node_id != nid) & ~np.isnan(u))
        findings.append(_slow_node_finding(tick, state, gid, nid, members, rest, waiting_drop[i],
                                           "idle" if idle[i] / cfg.node_idle_gap >= busier[i] / act_margin[i] else "busy"))
    return findings, standout, pairs


def _others(x: np.ndarray, pair_group: np.ndarray, per_group: np.ndarray, n_groups: int) -> np.ndarray:
    """For each node of a group, the typical value of the *other* nodes (exact for two nodes); x is
    (k, n_pairs), one row per reading, so every reading shares one grouped sort."""
    k = len(x)
    med = group_medians(x, pair_group, n_groups)[:, pair_group]
    filled = np.nan_to_num(x)
    ids = (pair_group + np.arange(k)[:, None] * n_groups).ravel()
    total = np.bincount(ids, weights=filled.ravel(), minlength=k * n_groups).reshape(k, n_groups)[:, pair_group]
    two = per_group[pair_group] == 2
    return np.where(two, total - filled, med)


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
