"""Node-level straggler detection: a node holding its group back while the other nodes wait in collectives
(its GPUs idle on their host, busier than the others', or with their clocks cut), and most GPUs of one
node standing out together (the node is named, not each GPU)."""

from __future__ import annotations

import math

from typing import AbstractSet, Any

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.detectors import Finding, r3, subject_fingerprint
from gpufleet.server.engine.detectors.straggler.node_pairs import NodeOffsets, NodePairs
from gpufleet.server.engine.config import SECONDS_PER_HOUR
from gpufleet.server.engine.detectors.straggler.common import (
    NOW_ROWS,
    PW,
    SM,
    UTIL,
    clock_cut,
    follow,
    learning_rate,
    newest,
    percent,
    scales,
)
from gpufleet.server.engine.detectors.straggler.policy import NODE, NODE_CLOCK_CUT, NODE_CROSS
from gpufleet.server.engine.groups import JOB
from gpufleet.server.engine.inference import inferred_peers, inferred_suffix
from gpufleet.server.engine.reduce import nan_median_first_axis, nan_to_zero
from gpufleet.server.engine.rules import MEAN_ABS_TO_SIGMA, MIDPOINT_RANK, any_of, evaluate
from gpufleet.server.engine.tick import THROTTLE_CAUSES, SlowdownSource, Tick, throttle_causes
from gpufleet.server.engine.detectors.straggler.state import StragglerState


def node_level(
    tick: Tick, state: StragglerState, halted: AbstractSet[int] = frozenset()
) -> tuple[list[Finding], set[tuple[int, int]], set[int], dict]:
    """Nodes holding their group back while the other nodes wait in collectives: their GPUs idle (host-
    bound), busier than the others' (slow), or with their clocks cut. Returns the findings, the (group,
    node) pairs standing out at the weaker margins, the groups where one of those idles, and the pairs."""
    cfg = tick.config
    w, grp = tick.windows, tick.groups
    sel = (grp.ngid >= 0) & ~np.isnan(tick.med["util"])
    if not sel.any():
        return [], set(), set(), {}
    lay = state.nodes.node_pairs(tick, grp.ngid, sel, w.slot_node_id[: w.n])
    if lay is None:
        return [], set(), set(), {}
    gids, nids = lay.gids, lay.nids
    r = _pair_readings(tick, lay)
    r.cross = _pair_cross_section(tick, state, lay, r)
    aged = tick.t - tick.registry.first_seen[gids] >= cfg.startup_grace_seconds
    r.cut &= tick.registry.one_job[gids] & r.steady & aged
    waiting = ((r.waiting_drop >= r.min_drop) & r.steady) | r.cross | r.cut
    fallback = ~tick.registry.one_job[gids]
    if fallback.any():
        waiting = np.where(fallback, _fallback_waiting(tick, lay) | r.cut, waiting)
    off, warming = _learn_pairs(tick, state.nodes, lay, r, waiting)
    r.act_spread = np.where(warming, np.nan, state.nodes.pair_noise[lay.idx])
    ready = ~warming & ~np.isnan(off[0]) & aged
    r.idle = r.gap - off[0]
    # Unattributed nodes are not known to run one job: a node "busier while the others wait" may just run
    # another job than the nodes whose job slowed (comm- or input-bound). It is judged only where its
    # activity matched the others' while healthy (learned offset within structural_max_offset), as the
    # nodes of one job do; two jobs that happen to run alike cannot be told apart.
    alike = tick.registry.one_job[gids] | (np.abs(off[1]) <= cfg.structural_max_offset)
    r.busier = np.where(r.node_busy & alike, r.act - nan_to_zero(off[1]), np.nan)
    results = _node_rules(cfg, r.idle, r.busier, r.by_power, r.act_spread, scales(cfg))
    held = any_of(results, _names(NODE))  # (2, pairs)
    # Standing out at the weaker margins holds the workload alerts back and keeps an alert open: that
    # stays within the node's wander (a node that may be the culprit is reason enough to hold back);
    # naming one takes a node beyond it.
    within = any_of(
        _node_rules(cfg, r.idle, r.busier, r.by_power, np.full_like(r.busier, np.nan), scales(cfg)), _names(NODE)
    )
    stands = (ready & waiting & within[1]) | r.cut
    # A node idling on its host explains its group's waiting: the other nodes of its group spin in
    # collectives for it, and one reading "busy while the others wait" beside it is a victim, never named.
    idle_stands = stands & results["straggler_node_idle"][1]
    victim = np.isin(gids, gids[idle_stands]) & ~idle_stands & ~r.cut
    stands &= ~victim
    # In a fallback group only the host-idle pattern names a node: nodes of other jobs wait for none.
    idle_named = fallback & results["straggler_node_idle"][0]
    on = _named_pairs(tick, lay, r, off, ready & waiting & held[0], alike, idle_named) & ~victim
    on &= ~_along_path(state.nodes, lay.idx, r, results["straggler_node_idle"][0])
    _follow_path(cfg, state.nodes, lay.idx, r.act, r.node_busy & ~on)
    if halted:
        live = ~np.isin(gids, list(halted))
        stands &= live
        on &= live
    standout = {(int(gids[i]), int(nids[i])) for i in stands.nonzero()[0].tolist()}
    idling = set(gids[idle_stands].tolist())
    findings = [f for i in on.nonzero()[0].tolist() if (f := _pair_finding(tick, state, lay, r, i)) is not None]
    return findings, standout, idling, dict(lay.pairs)


def _along_path(nodes: NodeOffsets, idx: np.ndarray | slice, r: _PairReadings, idle: np.ndarray) -> np.ndarray:
    """Per pair: named as busier alone (not idling, clocks not cut), under twice the margin cross-section,
    yet within the margin of its own path: the node's GPUs' load drifted up as a ramp its path followed
    (experts' routing), not by a fault's step. The full margin, not the weaker one a GPU's path is held
    to: a node's median of a few GPUs moves in jumps as its smoothing window turns over, and its margin is
    half a GPU's. No path yet holds nothing back."""
    rise = r.act - nodes.pair_path[idx]
    return ~idle & ~r.cut & ~r.cross & (rise < r.act_margin)


def _follow_path(cfg, nodes: NodeOffsets, idx: np.ndarray | slice, act: np.ndarray, follows: np.ndarray) -> None:
    """Follow each pair's activity against the other nodes (straggler_path_time_constant_seconds) where
    `follows` (its node busy, not named), also while its group waits; from its first reading."""
    rate = 1.0 - math.exp(-cfg.tick_seconds / cfg.straggler_path_time_constant_seconds)
    path = nodes.pair_path[idx]
    use = follows & ~np.isnan(act)
    nodes.pair_path[idx] = np.where(use, np.where(np.isnan(path), act, path + rate * (act - path)), path)


def _pair_cross_section(tick: Tick, state: StragglerState, lay: NodePairs, r: _PairReadings) -> np.ndarray:
    """Per pair: the node idles far more, or is far more active, than the other nodes spinning in its
    job, at twice the margins (NODE_CROSS): a node idle or slow from the job's start has no baseline.

    The idle gap is the raw one, as for a GPU's idle_cross: a node starved from the start learns part of
    its starvation as offset while it warms up.
    """
    prev = nan_to_zero(state.nodes.pair_offset[:, lay.idx])
    cross_arrays = {
        "node_gap": r.gap,
        "node_act": r.act - prev[1],
        "in_job": tick.registry.one_job[lay.gids],
        "steady": r.steady,
        "node_busy": r.node_busy,
        "by_sm": ~r.by_power,
        "by_power": r.by_power,
    }
    return any_of(evaluate(NODE_CROSS, cross_arrays, tick.config), _names(NODE_CROSS))


def _named_pairs(
    tick: Tick,
    lay: NodePairs,
    r: _PairReadings,
    off: np.ndarray,
    standing: np.ndarray,
    alike: np.ndarray,
    idle_named: np.ndarray,
) -> np.ndarray:
    """Per pair: the nodes to name: standing out at the full margins and still on their newest readings
    (as for a GPU: gpus.standing_now), or with their clocks cut, where the group may name a node (a job's;
    `idle_named`: a fallback group's node idling on its host, see _fallback_waiting)."""
    on = standing
    if on.any():
        on &= _pair_standing_now(tick, lay, off, r.node_busy & alike, r.by_power, r.act_spread)
    on |= r.cut
    return on & (_one_job(tick, lay.gids, lay.nids) | idle_named)


def _fallback_waiting(tick: Tick, lay: NodePairs) -> np.ndarray:
    """Per (group, node) pair of a fallback group (every unattributed GPU of a model, which may mix jobs):
    whether the busy GPUs of another node wait as a job's do for its straggler: slowed against their own
    baseline while spinning in collectives. The group's median cannot say so: the nodes of the job held
    back may be a few among many of other jobs. Where no job could be inferred (ranks that share no step
    wobble), a node idling on its host is then named by its idle gap; an idle node whose job merely idles
    (input-bound) has no other node waiting for it."""
    grp, cfg = tick.groups, tick.config
    n = len(grp.gid)
    min_drop = np.where(
        tick.slowdown_source == SlowdownSource.POWER, cfg.straggler_min_power_drop, cfg.straggler_min_slowdown
    )
    slowed = (tick.slowdown >= min_drop) & (grp.util >= cfg.straggler_waiting_utilization)
    slowed &= ~tick.registry.one_job[: grp.n_groups] & (grp.size >= cfg.straggler_min_group)
    waits = (grp.gid >= 0) & slowed[np.maximum(grp.gid, 0)]
    spin = np.where(grp.gid >= 0, grp.util[np.maximum(grp.gid, 0)], np.nan)
    node_of, util = tick.windows.slot_node_id[:n], tick.med["util"][:n]
    out = np.zeros(len(lay.gids), dtype=bool)
    for i in np.flatnonzero(~tick.registry.one_job[lay.gids]).tolist():
        group = grp.ngid == lay.gids[i]
        mine = group & (node_of == lay.nids[i]) & ~np.isnan(util)
        if not mine.any():
            continue
        # Spinning clearly more than this node runs: the nodes of a job that idles as a whole (input-
        # bound) are slowed too, but idle alike, and neither waits for the other.
        busier = spin >= float(np.nanmedian(util[mine])) + cfg.node_idle_gap
        out[i] = bool((waits & busier & group & ~mine).any())
    return out


class _PairReadings:
    """Per (group, node) pair of a NodePairs layout (its sel_pairs): the node's readings against the
    group's other nodes', and what node_level derives from them."""

    __slots__ = (
        "waiting_drop",
        "min_drop",
        "gap",
        "steady",
        "act",
        "act_margin",
        "by_power",
        "clk_dev",
        "cut",
        "others_cut",
        "node_busy",
        "cross",
        "idle",
        "busier",
        "act_spread",
    )
    waiting_drop: np.ndarray
    min_drop: np.ndarray
    gap: np.ndarray
    steady: np.ndarray
    act: np.ndarray
    act_margin: np.ndarray
    by_power: np.ndarray
    clk_dev: np.ndarray
    cut: np.ndarray
    others_cut: np.ndarray
    node_busy: np.ndarray
    cross: np.ndarray
    idle: np.ndarray
    busier: np.ndarray
    act_spread: np.ndarray  # the pair's usual wander of its activity (NodeOffsets.pair_noise)


def _pair_readings(tick: Tick, lay: NodePairs) -> _PairReadings:
    """The node's medians against the other nodes' (waiting drop, idle gap, activity, clocks), and the
    tests on them that need no learned offset."""
    cfg, m, gids = tick.config, tick.med, lay.gids
    r = _PairReadings()
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
    r.waiting_drop = np.where(np.isnan(drop_sm), drop_pw, drop_sm)
    r.min_drop = np.where(np.isnan(drop_sm), cfg.straggler_min_power_drop, cfg.straggler_min_slowdown)
    r.gap = o_u - node_u
    r.steady = o_u >= cfg.straggler_waiting_utilization
    r.act, r.by_power = _node_activity(node_sm, node_pw, o_sm, o_pw)
    r.act_margin = np.where(r.by_power, cfg.node_power_excess, cfg.straggler_sm_excess)
    # A node whose clocks are cut below the others', with slowdown bits they lack (a node-wide power brake,
    # HW slowdown), is slower whatever its activity says; as for a GPU (clock_cut), no baseline needed.
    # The others then draw more power spinning at full clocks: that is not "busy while the others wait".
    r.clk_dev = node_clk / o_clk - 1.0
    r.cut = clock_cut(cfg, r.clk_dev, node_slow, o_slow, NODE_CLOCK_CUT)
    r.others_cut = clock_cut(cfg, -r.clk_dev, o_slow, node_slow, NODE_CLOCK_CUT)  # -clk_dev: near enough for a margin
    # "Busy while the others wait" needs the others spinning at least as much as this node; others
    # that idle more than it are starved themselves (that is the host-idle pattern, on them).
    others_idle = r.gap < -cfg.node_idle_gap * cfg.straggler_others_idle_ratio
    r.node_busy = (node_u >= cfg.busy_utilization) & ~others_idle & ~r.others_cut
    return r


def _learn_pairs(
    tick: Tick, nodes: NodeOffsets, lay: NodePairs, r: _PairReadings, waiting: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Follow each pair's offsets (idle gap, activity) while its group runs steadily and unslowed; the
    offsets after this tick, and which pairs are still warming up."""
    cfg, idx = tick.config, lay.idx
    n_learned = nodes.pair_learned[idx]
    warming = n_learned < cfg.bins(cfg.startup_grace_seconds)
    learn = r.steady & (warming | ~waiting) & ~np.isnan(r.gap) & ~r.cut & ~r.others_cut
    off = follow(
        nodes.pair_offset[:, idx],
        np.array([r.gap, r.act]),
        learn,
        learning_rate(cfg, n_learned, ~tick.registry.one_job[lay.gids]),
    )
    # Nodes of one job run the same steps: as for GPUs (see gpus.learn), an offset in the culprit direction
    # is capped, and none is learned in the victim direction (it would set a recovered node apart).
    cap = cfg.structural_max_offset
    off = nodes.pair_offset[:, idx] = np.where(tick.registry.one_job[lay.gids], np.clip(off, 0.0, cap), off)
    nodes.pair_learned[idx] = n_learned + learn
    _learn_wander(cfg, nodes, idx, r.act, learn & ~warming, off)
    return off, warming


def _learn_wander(
    cfg, nodes: NodeOffsets, idx: np.ndarray | slice, act: np.ndarray, settled: np.ndarray, off: np.ndarray
) -> None:
    """Follow each pair's mean activity against the other nodes and its wander about it while it runs
    unslowed after its warm-up (the running mean, then as slowly as the offsets). A node's median over
    a few GPUs against one other node's is noisy, more so at slow sampling and on power, and a fixed
    margin names either node by turns; the margin widens to the wander (policy.NODE)."""
    learned = nodes.pair_mean_learned[idx]
    slow = 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds)
    rate = np.maximum(1.0 / (learned + 1.0), slow)
    mean = nodes.pair_mean[idx] = follow(nodes.pair_mean[idx], act, settled, rate)
    wander = np.abs(act - np.where(np.isnan(mean), off[1], mean)) * MEAN_ABS_TO_SIGMA
    nodes.pair_noise[idx] = follow(nodes.pair_noise[idx], wander, settled, rate)
    nodes.pair_mean_learned[idx] = learned + settled


def _pair_finding(tick: Tick, state: StragglerState, lay: NodePairs, r: _PairReadings, i: int) -> Finding | None:
    """The finding for pair i, named by what set it apart; None for an unattributed node found busier
    on its median whose GPUs are not busier rank for rank (see _node_wide_busy)."""
    cfg, w, ng = tick.config, tick.windows, tick.groups.ngid
    u, node_id = tick.med["util"], w.slot_node_id[: w.n]
    gid, nid = int(lay.gids[i]), int(lay.nids[i])
    members = np.flatnonzero((ng == gid) & (node_id == nid) & ~np.isnan(u))
    rest = np.flatnonzero((ng == gid) & (node_id != nid) & ~np.isnan(u))
    idle_score, busy_score = r.idle[i] / cfg.node_idle_gap, r.busier[i] / r.act_margin[i]
    # NaN busy score: not judged (unattributed) or unknown; then what fired is the idle gap.
    pattern = "cut" if r.cut[i] else "busy" if busy_score == busy_score and not idle_score >= busy_score else "idle"
    if (
        pattern == "busy"
        and not tick.registry.one_job[gid]
        and not _node_wide_busy(tick, members, rest, float(r.act_margin[i]))
    ):
        return None
    drop = r.waiting_drop[i]
    slowdown = drop if drop == drop else 0.0
    if pattern == "cut" and r.clk_dev[i] < 0.0:
        # At a fraction of the others' clocks each step takes that much longer (compute-bound).
        slowdown = max(slowdown, float(-r.clk_dev[i]))
    elif r.cross[i]:
        # The others' share of each step spent waiting: the idle gap, or their activity against this node's.
        slowdown = max(slowdown, r.gap[i] if pattern == "idle" else 1.0 - 1.0 / (1.0 + max(float(r.act[i]), 0.0)))
    return _slow_node_finding(tick, state, gid, nid, members, rest, slowdown, pattern)


def _one_job(tick: Tick, gids: np.ndarray, nids: np.ndarray) -> np.ndarray:
    """Per (group, node) pair: whether the node may be named. A fallback group of all the unattributed
    GPUs of one model may mix jobs: a node "holding back" the others there may just run another job than
    theirs, so only a job names a node. An inferred job names one only where it holds at least
    straggler_min_group of the node's GPUs, and as many on the other nodes it is compared with: one GPU
    that moved with a job for a while is neither a node nor the peers a node holds back."""
    reg, ng = tick.registry, tick.groups.ngid
    ok = reg.one_job[gids]
    inferred = ok & ~reg.is_job[gids]
    if inferred.any():
        node_of = tick.windows.slot_node_id[: len(ng)]
        least = tick.config.straggler_min_group
        for i in np.flatnonzero(inferred).tolist():
            member = ng == gids[i]
            held = np.count_nonzero(member & (node_of == nids[i]))
            ok[i] = held >= least and np.count_nonzero(member) - held >= least
    return ok


def _node_rules(
    cfg, idle: np.ndarray, busier: np.ndarray, by_power: np.ndarray, spread: np.ndarray, scale
) -> dict[str, np.ndarray]:
    """Per (group, node) pair at each scale: each node rule (idle gap, or activity excess where judged
    busy, beyond the learned offsets and the pair's usual wander)."""
    arrays = {"node_idle": idle, "node_busier": busier, "by_sm": ~by_power, "by_power": by_power}
    arrays["node_spread"] = spread
    return evaluate(NODE, arrays, cfg, scale)


def _names(rules) -> list[str]:
    return [r.name for r in rules]


def _pair_standing_now(
    tick: Tick, lay: NodePairs, off: np.ndarray, judged_busy: np.ndarray, by_power: np.ndarray, spread: np.ndarray
) -> np.ndarray:
    """Per (group, node) pair: whether node_level's rules still hold at the weaker margins on the newest
    readings (see gpus.standing_now); True where the node has none (no evidence against)."""
    cfg = tick.config
    now = newest(tick, NOW_ROWS[: UTIL + 1])
    if now is None:
        return np.ones(len(judged_busy), dtype=bool)
    nodes = lay.members.medians(now)
    node_sm, node_pw, _, node_u = nodes[:, lay.sel_pairs]
    o_sm, o_pw, _, o_u = _others(nodes, lay)[:, lay.sel_pairs]
    act, _ = _node_activity(node_sm, node_pw, o_sm, o_pw)
    idle = o_u - node_u - off[0]
    busier = np.where(judged_busy, act - nan_to_zero(off[1]), np.nan)
    unknown = np.isnan(idle) & np.isnan(busier)
    held = _node_rules(cfg, idle, busier, by_power, spread, cfg.straggler_weak_margin_ratio)
    return any_of(held, _names(NODE)) | unknown


def _node_wide_busy(tick: Tick, members: np.ndarray, rest: np.ndarray, act_margin: float) -> bool:
    """Whether at least half of an unattributed node's GPUs are busier than the other nodes' GPUs on their
    own, rank for rank (the node's k-th lowest activity against the others' matching quantile), each by
    the whole node margin (a smaller one lets GPU-to-GPU noise in power pass at random ranks); "half of the
    node's GPUs" is straggler_node_share_ratio.

    Unattributed nodes are compared over all their GPUs, which may run two jobs: then each node's
    readings are two clusters, its median falls between them, and one slow GPU moves it across the node
    margin. Compared rank for rank, that node differs at one rank; a slow node at most of them.
    """
    row = SM if not np.isnan(tick.levels[SM, members]).all() else PW
    mine, theirs = np.sort(tick.levels[row, members]), tick.levels[row, rest]
    ok = ~np.isnan(mine)
    if not ok.any() or np.isnan(theirs).all():
        return False
    q = (np.arange(len(mine)) + MIDPOINT_RANK) / len(mine)
    busier = mine[ok] / np.nanquantile(theirs, q[ok]) - 1.0 >= act_margin
    return int(np.count_nonzero(busier)) >= tick.config.straggler_node_share_ratio * len(mine)


def _others(x: np.ndarray, lay: NodePairs) -> np.ndarray:
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
        return other  # the only pairs that count are in groups of two nodes
    two = lay.per_group[pair_group] - 1 == 1  # one other node: its value is exact
    return np.where(two, other, lay.nodes_of_group.medians(x)[:, pair_group])


def _node_activity(
    node_sm: np.ndarray, node_pw: np.ndarray, o_sm: np.ndarray, o_pw: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A node's activity relative to the other nodes' less 1: SM activity, or power where that is
    unsupported; and where power was used."""
    act_sm = node_sm / o_sm - 1.0
    by_power = np.isnan(act_sm)
    return np.where(by_power, node_pw / o_pw - 1.0, act_sm), by_power


def whole_node(tick: Tick, state: StragglerState, on: np.ndarray, weak: np.ndarray, idle: np.ndarray):
    """Most GPUs of one node standing out together: the node is the culprit (gpu null), not each GPU
    (idle: per slot, standing out by idling on its host; most of the node's named GPUs so: host-bound)."""
    w, grp = tick.windows, tick.groups
    g = grp.gid
    members = (g >= 0) & ~np.isnan(tick.med["util"])
    if not on.any():
        return [], set(), {}, on
    n_nodes = len(w.node_names)
    key = np.where(members, g * n_nodes + w.slot_node_id[: w.n], -1)
    uniq, inv = np.unique(key[members], return_inverse=True)
    n_pairs = len(uniq)
    size = np.bincount(inv, minlength=n_pairs)
    n_on = np.bincount(inv, weights=on[members], minlength=n_pairs)
    n_weak = np.bincount(inv, weights=weak[members], minlength=n_pairs)
    pair_group = uniq // n_nodes
    share = tick.config.straggler_node_share_ratio * size
    spans = np.bincount(pair_group, minlength=grp.n_groups)[pair_group] > 1
    whole = spans & (n_on > 1) & (n_weak >= share)
    stands = spans & (n_weak > 1) & (n_weak >= share)
    findings, standout, pairs = [], set(), {}
    on = on.copy()
    member_slots = np.flatnonzero(members)
    for p in stands.nonzero()[0].tolist():
        gid, nid = int(uniq[p] // n_nodes), int(uniq[p] % n_nodes)
        standout.add((gid, nid))
        pairs[state.nodes.node_fingerprint(tick, gid, nid)] = (gid, nid)
    for p in whole.nonzero()[0].tolist():
        gid, nid = int(uniq[p] // n_nodes), int(uniq[p] % n_nodes)
        slots = member_slots[inv == p]
        others = member_slots[(pair_group[inv] == gid) & (inv != p)]
        named = slots[on[slots]]
        most = np.count_nonzero(idle[named]) > tick.config.straggler_node_share_ratio * len(named)
        pattern = "idle" if most else "busy"
        on[slots] = False
        findings.append(_slow_node_finding(tick, state, gid, nid, slots, others, pattern=pattern))
    return findings, standout, pairs, on


def _slow_node_finding(
    tick: Tick,
    state: StragglerState,
    gid: int,
    nid: int,
    slots: np.ndarray,
    others: np.ndarray,
    slowdown: float | None = None,
    pattern: str = "busy",
) -> Finding:
    """The finding for a node holding its group back (slots: its GPUs; others: the other nodes' GPUs),
    assembled from its cost, evidence and wording; pattern: busy, idle (host-bound) or cut (clocks)."""
    cfg = tick.config
    node = tick.windows.node_names[nid]
    job = tick.registry.job(gid)
    slowdown = float(tick.slowdown[gid]) if slowdown is None else float(slowdown)
    known = slowdown == slowdown  # NaN: the job has no baseline yet (a node slow from its start)
    fp = subject_fingerprint(AlertKind.STRAGGLER, node, None, job)
    cost = (max(slowdown, 0.0) if known else 0.0) * int(tick.groups.size[gid]) * cfg.tick_seconds / SECONDS_PER_HOUR
    lost = state.add_cost(fp, tick.t, cost)
    causes = throttle_causes(tick, slots)
    evidence = _node_evidence(tick, gid, slots, others, slowdown, lost)
    what = _node_what(evidence, pattern, causes)
    evidence["pattern"] = {"idle": "host_idle", "cut": "node_clocks_cut"}.get(pattern, "node_slow")
    evidence["throttle_causes"] = causes
    if tick.registry.kind(gid) != JOB:
        evidence["note"] = "no hpc_job attribution: compared with unattributed nodes of the same GPU model"
    inferred_peers(tick.registry, gid, evidence)
    summary = _node_summary(node, job, evidence, what, known)
    # What it costs decides whether it is critical (engine/severity.py): nothing is lost or corrupted.
    sev = Severity.WARNING
    return Finding(AlertKind.STRAGGLER, node, None, None, job, sev, summary, evidence, cost_gpu_hours=cost)


def _node_evidence(
    tick: Tick, gid: int, slots: np.ndarray, others: np.ndarray, slowdown: float, lost: float
) -> dict[str, Any]:
    """The node's medians against the other nodes' (None: unknown), and the slowdown put down to it."""
    node_sm, node_pw, node_clk, node_u = map(r3, nan_median_first_axis(tick.levels[:, slots].T).tolist())
    rest_sm, rest_pw, rest_clk, rest_u = map(r3, nan_median_first_axis(tick.levels[:, others].T).tolist())
    return {
        "peer_group": tick.registry.kind(gid),
        "peer_group_size": int(tick.groups.size[gid]),
        "node_gpus": int(len(slots)),
        "node_median_sm_active_ratio": node_sm,
        "other_nodes_sm_active_ratio": rest_sm,
        "node_median_sm_clock_ratio": node_clk,
        "other_nodes_sm_clock_ratio": rest_clk,
        "node_median_power_watts": node_pw,
        "other_nodes_power_watts": rest_pw,
        "node_median_utilization_ratio": node_u,
        "other_nodes_utilization_ratio": rest_u,
        "estimated_job_slowdown_ratio": r3(slowdown),
        "gpu_hours_lost": round(lost, tick.config.straggler_gpu_hours_digits),
    }


def _node_what(evidence: dict[str, Any], pattern: str, causes: list[str]) -> str:
    """What sets the node apart, in words."""
    if pattern == "idle":
        return (
            "its GPUs idle, waiting on their host, while the other nodes wait for it (utilization "
            f"{_two(evidence['node_median_utilization_ratio'])} against "
            f"{_two(evidence['other_nodes_utilization_ratio'])})"
        )
    if pattern == "cut":
        node_clk, rest_clk = evidence["node_median_sm_clock_ratio"], evidence["other_nodes_sm_clock_ratio"]
        return (
            "its GPUs' clocks are cut, with throttle bits the other nodes lack, while they wait for it (SM clock "
            f"{_pct(node_clk)} of max against {_pct(rest_clk)}"
            + "".join("; " + THROTTLE_CAUSES[c] for c in causes)
            + ")"
        )
    node_sm, rest_sm = evidence["node_median_sm_active_ratio"], evidence["other_nodes_sm_active_ratio"]
    return "its GPUs are still computing while the other nodes wait for it" + (
        f" (SM activity {_two(node_sm)} against {_two(rest_sm)})" if node_sm is not None and rest_sm is not None else ""
    )


def _node_summary(node: str, job: str | None, evidence: dict[str, Any], what: str, known: bool) -> str:
    """One line: which node is the slow one and why, then what its job loses to it as it fired."""
    # Worded as a GPU straggler's figure (see gpu_finding): the slowdown put down to this node, as it fires.
    share = evidence["estimated_job_slowdown_ratio"]
    loses = (
        f". {'Job ' + job if job else 'Its peer nodes'} lose{'s' if job else ''} ~{percent(share)} per step to it "
        "(estimated as it fired)"
        if known and isinstance(share, float)
        else ""
    )
    return f"node {node} is the slow one: {what}{loses}" + inferred_suffix(evidence)


def _pct(ratio: float | None) -> str:
    """A ratio as a whole percentage for a summary ('?' when unknown)."""
    return "?" if ratio is None else percent(ratio)


def _two(ratio: float | None) -> str:
    """A ratio as a summary quotes it: two decimals ('0.74'), '?' where unknown."""
    return "?" if ratio is None else f"{ratio:.2f}"
