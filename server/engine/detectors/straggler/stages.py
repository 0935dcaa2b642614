"""The stages of straggler.detect(), in the order it runs them; each returns what the next ones read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AbstractSet

import numpy as np

from gpufleet.server.engine.detectors import Finding
from gpufleet.server.engine.detectors.straggler.common import PW, SM, UTIL, scales
from gpufleet.server.engine.detectors.straggler.conditions import GroupConditions, group_conditions
from gpufleet.server.engine.detectors.straggler.gpus import (
    SharedNode,
    beyond_role,
    cuts,
    deviation,
    excess_in_noise,
    follow_path,
    group_spread,
    learn,
    learned_noise,
    mixed_fallback,
    reset_moved,
    shared_node,
    shared_roles,
    signals,
    standing_now,
)
from gpufleet.server.engine.detectors.straggler.nodes import node_level, whole_node
from gpufleet.server.engine.detectors.straggler.policy import BEYOND_NOISE, CROSS_SECTION, RANK_IDLE
from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.detectors.straggler.steps import Steps, find_steps, job_peers, node_peers
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.reduce import nan_median_first_axis, nan_to_zero
from gpufleet.server.engine.rules import any_of, evaluate
from gpufleet.server.engine.tick import Tick


def _names(rules) -> list[str]:
    return [r.name for r in rules]


@dataclass(frozen=True, slots=True)
class Slots:
    """Where each GPU sits this tick."""

    n: int
    gid: np.ndarray  # its group (-1: none)
    in_group: np.ndarray
    group_of: np.ndarray  # its group, 0 outside groups: an index to gather per-group arrays with


def place_gpus(tick: Tick, state: StragglerState) -> Slots:
    """Each slot's group this tick; a GPU that moved to another group starts learning afresh."""
    n = tick.windows.n
    gid = tick.groups.gid
    in_group = gid >= 0
    carried = tick.registry.carried
    if len(carried) < n:
        carried = np.concatenate([carried, np.zeros(n - len(carried), dtype=bool)])
    in_job = in_group & tick.registry.one_job[np.maximum(gid, 0)]
    rebase = in_job & carried[:n] & (gid != state.learned_gid[:n])
    before = state.learned_gid[:n].copy()
    reset_moved(state, tick.config, gid, carried, in_job)
    slots = Slots(n, gid, in_group, np.where(in_group, gid, 0))
    if rebase.any():
        _rebase_carried(tick, state, slots, np.flatnonzero(rebase), before)
    return slots


def _rebase_carried(tick: Tick, state: StragglerState, slots: Slots, moved: np.ndarray, before: np.ndarray) -> None:
    """A GPU carried from a part of the inferred job it joined (a node's busy GPUs) learned its offsets
    against that part's peers; against the job's they are what it reads against them now, held to a job's
    structural range (as gpus.reset_moved holds them). A part of one role (a node that is the last
    pipeline stage) learned none against itself, and its whole role stood out in the job as a slowdown."""
    cap = tick.config.structural_max_offset
    peers = tick.groups.levels[:, slots.group_of[moved]]
    dev = deviation(tick.levels[:, moved], peers)[:UTIL]
    sign = np.array([[1.0], [1.0], [-1.0]])  # culprit direction per row: busier, busier, clocks lower
    held = sign * np.clip(sign * dev, 0.0, cap)
    _rebase_roles(tick, state, slots, moved, before, dev[: PW + 1])
    state.offset[:UTIL, moved] = np.where(np.isnan(dev), state.offset[:UTIL, moved], held)


def _rebase_roles(
    tick: Tick, state: StragglerState, slots: Slots, moved: np.ndarray, before: np.ndarray, dev: np.ndarray
) -> None:
    """The roles of GPUs carried into an inferred job, against the job: their part's median deviation
    (a part of straggler_min_group or more GPUs, whose median one straggler does not move) plus each
    one's offset within its part as held to the structural range. A part's role (a node holding the
    last pipeline stage) is then known from the moment it joins, while a GPU slow from the start is not
    absorbed; a smaller part learns its roles afresh (gpus.shared_roles waits for them)."""
    cfg = tick.config
    key = before[moved] * tick.groups.n_groups + slots.gid[moved]
    _, part, size = np.unique(key, return_inverse=True, return_counts=True)
    medians = np.array([nan_median_first_axis(dev[:, part == p].T) for p in range(len(size))]).T
    within = nan_to_zero(state.offset[: PW + 1, moved])
    big = size[part] >= cfg.straggler_min_group
    state.role[:, moved] = np.where(big, medians[:, part] + within, np.nan)
    state.role_learned[moved] = np.where(big, cfg.bins(cfg.role_offset_seconds), 0)


@dataclass(frozen=True, slots=True)
class Readings:
    """Per slot: each GPU against its group's medians and its own learned offsets."""

    deviation: np.ndarray  # rows as groups.LEVELS, against the group's medians (gpus.deviation)
    excess: np.ndarray  # the deviation less the GPU's learned offset (beyond a shared role: gpus.beyond_role)
    shared_roles: np.ndarray  # rows SM activity and power: its excesses are taken beyond its role (gpus.shared_roles)
    sm_unknown: np.ndarray  # its group reports no SM activity
    utilization: np.ndarray
    busy: np.ndarray
    warm_ticks: np.ndarray  # ticks of learning before it is judged against its offsets
    was_warm: np.ndarray  # it had learned that long before this tick's learning
    peer_slow_share: np.ndarray  # its group's share of slowdown bits
    clocks_cut: np.ndarray
    victim: np.ndarray  # spinning at full clocks beside a GPU whose clocks are cut (gpus.cuts)
    conditions: GroupConditions


def read_gpus(tick: Tick, state: StragglerState, slots: Slots, halted: AbstractSet[int]) -> Readings:
    """Each GPU's deviation and excess, clock cuts, warmth and its group's conditions."""
    cfg = tick.config
    group_of, in_group = slots.group_of, slots.in_group
    peers = tick.groups.levels[:, group_of]  # each slot's group medians
    dev = deviation(tick.levels, peers)
    conditions = group_conditions(tick, state, cfg, halted).at(group_of, in_group)
    warm_ticks = _warm_ticks(tick, slots)
    utilization = tick.med["util"]
    peer_slow_share = tick.groups.slow[group_of]
    cut, victim = cuts(tick, cfg, dev, peer_slow_share, group_of, in_group)  # sets dev's clock row for a cut GPU
    shared = shared_roles(state, cfg, slots.gid)
    return Readings(
        deviation=dev,
        excess=beyond_role(state, dev, dev - nan_to_zero(state.offset), shared),
        shared_roles=shared,
        sm_unknown=np.isnan(peers[SM]),
        utilization=utilization,
        busy=(utilization >= cfg.busy_utilization) & in_group,
        warm_ticks=warm_ticks,
        was_warm=state.learned[: slots.n] >= warm_ticks,
        peer_slow_share=peer_slow_share,
        clocks_cut=cut,
        victim=victim,
        conditions=conditions,
    )


def _warm_ticks(tick: Tick, slots: Slots) -> np.ndarray:
    """Per slot: the startup grace in ticks, or its running-grace share where the group was already
    running when first seen (it has no start-up to forget)."""
    cfg = tick.config
    return np.where(
        tick.registry.dated[slots.group_of] & slots.in_group,
        cfg.bins(cfg.startup_grace_seconds * cfg.straggler_running_grace_ratio),
        cfg.bins(cfg.startup_grace_seconds),
    )


@dataclass(frozen=True, slots=True)
class Judged:
    """Per slot: who may be judged, and who stands out from its peers with no baseline needed."""

    rule_inputs: dict[str, np.ndarray]  # the arrays RANK_IDLE, CROSS_SECTION and BEYOND_NOISE read
    by_baseline: np.ndarray  # judged against its learned offsets and its group's baseline
    by_cross_section: np.ndarray  # judged against its peers alone
    idle: np.ndarray  # (2, n) at scales(): idles on its host below its peers
    idle_cross: np.ndarray  # idles far below its peers, judged without a baseline
    cross_plain: np.ndarray  # (2, n) at scales(): CROSS_SECTION holds
    cross: np.ndarray  # stands out from its peers with no baseline needed (cross-section or clocks cut)
    starved: np.ndarray  # a job's GPU that may wait on its host


def judge(tick: Tick, state: StragglerState, slots: Slots, read: Readings) -> Judged:
    """Who may be judged, by its baseline or by the cross-section alone, and who stands out so."""
    cfg, cond = tick.config, read.conditions
    judgeable = read.was_warm & cond.judgeable
    starved = cond.one_job & ~read.victim
    rule_inputs = _rule_inputs(tick, state, slots, read, starved)
    held = evaluate(RANK_IDLE + CROSS_SECTION, rule_inputs, cfg, scales(cfg))
    idle_cross = held["straggler_rank_idle_cross"][0]
    idle = any_of(held, _names(RANK_IDLE))
    # Peers spinning far below one GPU's activity wait for it, even where the job never had a baseline.
    cross_plain = any_of(held, _names(CROSS_SECTION))
    # A clock cut is the GPU's own hardware slowing it, whatever runs beside it: it counts without a job.
    cross = (cross_plain[0] | cond.one_job & idle_cross) | read.clocks_cut & slots.in_group
    by_cross_section = ((read.busy & cross) | idle_cross) & cond.cross_steady
    # An inferred job's membership is a reading of co-movement: only a GPU that learned in it, or whose
    # clocks are cut, is judged by the cross-section there.
    inferred = (tick.registry.one_job & ~tick.registry.is_job)[: tick.groups.n_groups][slots.group_of]
    by_cross_section &= ~(inferred & slots.in_group) | read.was_warm | read.clocks_cut
    return Judged(
        rule_inputs=rule_inputs,
        by_baseline=(read.busy & judgeable) | (idle[1] & judgeable),
        by_cross_section=by_cross_section,
        idle=idle,
        idle_cross=idle_cross,
        cross_plain=cross_plain,
        cross=cross,
        starved=starved,
    )


def _rule_inputs(
    tick: Tick, state: StragglerState, slots: Slots, read: Readings, starved: np.ndarray
) -> dict[str, np.ndarray]:
    """The arrays the rank-idle and cross-section rules read: excesses, gaps and the group's noise.

    A rank idling on its host is judged only in a job (starved: an unattributed GPU idling more than its
    node's others may just run other work), and only while it computes at all (computing: a GPU of the
    allocation the job never uses holds nobody back).
    """
    ex, noise = read.excess, learned_noise(state, tick.config, slots.n)
    return {
        "sm_excess": ex[SM],
        "power_excess": ex[PW],
        "idle_excess": -ex[UTIL],
        "idle_gap": -read.deviation[UTIL],
        "sm_spread": noise[SM],
        "power_spread": noise[PW],
        "idle_spread": noise[UTIL],
        "starved": starved,
        "computing": read.utilization >= tick.config.job_active_utilization,
        "in_job": read.conditions.one_job,
        "sm_supported": ~read.sm_unknown,
        "sm_unsupported": read.sm_unknown,
    }


@dataclass(frozen=True, slots=True)
class Culprits:
    """Per slot: the GPUs to name, and what the alerts' hold and clear tests read."""

    named: np.ndarray  # stands out in the culprit direction at the full margins while its peers wait
    weak: np.ndarray  # stands out at the weaker margins
    hardware: np.ndarray  # (2, n) at scales(): stands out by clocks or slowdown bits, not activity alone
    waiting: np.ndarray  # its peers wait: slowed against their baseline, or it stands out cross-section
    # Stands out at the full margins while its peers do not wait (yet): named the moment they do, so its
    # path holds (gpus.follow_path).
    unwaited: np.ndarray


def find_culprits(tick: Tick, state: StragglerState, slots: Slots, read: Readings, judged: Judged) -> Culprits:
    """GPUs standing out in the culprit direction while their peers wait, still so on their newest readings."""
    cfg, cond = tick.config, read.conditions
    waiting = (cond.slowed | judged.cross) & cond.peers_spinning
    culprit, hardware = signals(
        cfg, read.excess, tick.levels[: PW + 1], state, read.sm_unknown, tick.med["slow"], read.peer_slow_share
    )
    full, weak = ((culprit | read.clocks_cut) & ~read.victim) | judged.idle
    named = (judged.by_baseline | judged.by_cross_section) & waiting & full
    named &= standing_now(tick, cfg, state, slots.group_of, read.sm_unknown, named, read.shared_roles)
    by_activity = named & ~(hardware[0] | read.clocks_cut | judged.idle[0])
    named &= ~_below_peers(read, by_activity, cfg)
    named &= ~_along_path(state, read, by_activity & ~judged.cross_plain[0], cfg)
    return Culprits(named, weak, hardware, waiting, full & ~waiting)


def _along_path(state: StragglerState, read: Readings, by_activity: np.ndarray, cfg) -> np.ndarray:
    """Per slot: named by its activity alone, under twice the margin cross-section, yet within the weaker
    margin of its own path (gpus.follow_path): it got there as a ramp its path followed, as an expert's
    drifting load does over minutes, not by a fault's step. A GPU with no path yet is not held back."""
    unknown = read.sm_unknown
    act_dev = np.where(unknown, read.deviation[PW], read.deviation[SM])
    path = state.path[:, : len(unknown)]
    margin = np.where(unknown, cfg.straggler_power_excess, cfg.straggler_sm_excess)
    rise = act_dev - np.where(unknown, path[PW], path[SM])
    return by_activity & (rise < cfg.straggler_weak_margin_ratio * margin)


def _below_peers(read: Readings, by_activity: np.ndarray, cfg) -> np.ndarray:
    """Per slot: named by its activity alone, yet no busier than its peers' median now by the weaker
    margin: its excess is against an offset learned below theirs (an expert's load drifting up in a
    group whose offsets are free), and peers do not wait for a GPU that finishes its steps before them."""
    act_dev = np.where(read.sm_unknown, read.deviation[PW], read.deviation[SM])
    margin = np.where(read.sm_unknown, cfg.straggler_power_excess, cfg.straggler_sm_excess)
    return by_activity & ~(act_dev >= cfg.straggler_weak_margin_ratio * margin)


def add_steps(
    tick: Tick,
    state: StragglerState,
    slots: Slots,
    read: Readings,
    culprits: Culprits,
    halted: AbstractSet[int] = frozenset(),
) -> tuple[Culprits, Steps]:
    """The culprits plus the GPUs of jobs whose standing against their peers stepped up (steps.py), judged
    where their peers spin; a GPU named so learns no offset meanwhile (it counts as waited for). In an
    inferred job only where SM activity is reported: power also moves with the collective's share of the
    step, and a change of a job's communication can step one noisy GPU's power up as the job's falls
    (inference keeps two jobs' levels apart, and _many refuses a change of phase that moves many GPUs)."""
    cfg, cond = tick.config, read.conditions
    reg, group_of = tick.registry, slots.group_of
    attributed = reg.is_job[: tick.groups.n_groups][group_of]
    in_job = (attributed | reg.one_job[: tick.groups.n_groups][group_of] & ~read.sm_unknown) & slots.in_group
    # Not a victim: beside GPUs whose clocks are cut, its peers' median falls with them and it spins on.
    judged = read.busy & read.was_warm & cond.judgeable & in_job & cond.peers_spinning & ~read.victim
    # A culprit keeps working (as gpus.signals asks): a job hung in its collective falls on every GPU.
    level, own = state.level[:, : slots.n], tick.levels[: PW + 1]
    kept = np.where(
        read.sm_unknown,
        ~(own[PW] < cfg.straggler_power_kept_ratio * level[PW]),
        ~(own[SM] < cfg.straggler_sm_kept_ratio * level[SM]),
    )
    steps = find_steps(tick, state.steps, job_peers(tick, slots.group_of), judged, read.sm_unknown, kept)
    named = culprits.named | steps.on
    steps = _node_steps(tick, state, slots, read, kept, steps, halted, named)
    return (
        replace(
            culprits,
            named=culprits.named | steps.on,
            weak=culprits.weak | steps.on,
            waiting=culprits.waiting | steps.on,
        ),
        steps,
    )


def _node_of_one_group(node_of: np.ndarray, gid: np.ndarray, loose: np.ndarray) -> np.ndarray:
    """Per slot: every `loose` GPU of its node group (node_of) is in the same peer group (gid)."""
    pairs = np.unique(np.stack([node_of[loose], gid[loose]]), axis=1)
    groups = np.bincount(pairs[0], minlength=int(node_of.max(initial=0)) + 1)
    return groups[node_of] == 1


def _node_steps(
    tick: Tick,
    state: StragglerState,
    slots: Slots,
    read: Readings,
    kept: np.ndarray,
    steps: Steps,
    halted: AbstractSet[int],
    named: np.ndarray,
) -> Steps:
    """The steps with those of GPUs no job holds (unattributed, in no inferred job: inference can leave a
    job in pieces it is not sure of, or hold a GPU only since a moment ago), each judged against its
    node's busy unattributed GPUs of its model with SM activity: at least straggler_min_group of them,
    their median at the waiting level, none in a halted group. Its own trail, which a group's restart
    does not forget: a node group restarts whenever inference moves some of its GPUs into or out of a
    piece, and the rule's warm-up (both stretches judged) is its own."""
    cfg = tick.config
    reg, group_of = tick.registry, slots.group_of
    unattributed = slots.in_group & ~reg.is_job[: tick.groups.n_groups][group_of]
    loose = read.busy & unattributed & ~read.sm_unknown & ~np.isnan(tick.levels[SM])
    if not loose.any() and state.node_steps.holds_none():
        # No GPU to judge and no step to keep or clear (a fleet whose jobs are all attributed): the
        # trail only records the tick.
        state.job_steps_settled = np.zeros(slots.n, dtype=bool)
        state.node_steps.pass_tick(tick.k, slots.n, cfg)
        return Steps(steps.on, steps.size, steps.fall, np.zeros(slots.n, dtype=bool))
    if halted:  # a GPU lost while busy hangs its job, and without attribution every group of its model
        loose &= ~np.isin(slots.gid, list(halted))
    peers = node_peers(tick, loose)
    median_util = peers.medians(np.where(loose, read.utilization, np.nan)[None, :])[0][peers.of]
    in_job = reg.one_job[: tick.groups.n_groups][group_of]
    # Also a GPU of an inferred job until its job's trail first can find a step (inference can take
    # minutes to hold it; once it could, a later regrouping is the job's to judge), where its job holds every busy GPU of its node (a node shared with another job mixes the
    # two jobs' changes of work) and names no straggler already (its peers' fall is that one's), and
    # while a step found here holds.
    settled = grown(state.job_steps_settled, slots.n, False)[: slots.n]
    settled = loose & in_job & (settled | state.steps.ready(tick.k, cfg)[: slots.n])
    state.job_steps_settled = settled
    explained = np.bincount(slots.gid[named & slots.in_group], minlength=tick.groups.n_groups)[group_of] > 0
    job_ready = settled | ~_node_of_one_group(peers.of, slots.gid, loose) | explained
    held = ~np.isnan(state.node_steps.before[: slots.n]) if len(state.node_steps.before) >= slots.n else False
    judged = loose & (~in_job | ~job_ready | held) & ~read.victim & (peers.size[peers.of] >= cfg.straggler_min_group)
    judged &= median_util >= cfg.straggler_waiting_utilization
    node = find_steps(tick, state.node_steps, peers, judged, read.sm_unknown, kept)
    use = node.on & ~steps.on
    return Steps(steps.on | node.on, np.where(use, node.size, steps.size), np.where(use, node.fall, steps.fall), use)


def find_shared_node(tick: Tick, state: StragglerState, slots: Slots, read: Readings) -> SharedNode:
    """The one GPU busier than its usual level in an unattributed node group of two jobs (gpus.shared_node)."""
    cfg = tick.config
    judged = read.busy & (read.utilization >= cfg.straggler_waiting_utilization) & read.was_warm
    return shared_node(tick, cfg, state, slots.group_of, judged & read.conditions.judgeable, read.sm_unknown)


def learn_offsets(
    tick: Tick, state: StragglerState, slots: Slots, read: Readings, waiting: np.ndarray, held: np.ndarray
) -> None:
    """Learn offsets, usual levels and noise from GPUs doing what their peers do (gpus.learn), and each
    busy GPU's own path past its learning unless `held` (named, or named once its peers wait:
    gpus.follow_path)."""
    cfg = tick.config
    follow_path(state, cfg, read.deviation, read.deviation - read.excess, read.busy & read.was_warm & ~held)
    # Not from a GPU with its clocks cut, its full-clock peers meanwhile, nor one idling well below its
    # peers: what it reads then is no structural offset, and the recovered GPU would stand out.
    idling = read.deviation[UTIL] <= -cfg.node_idle_gap
    steady = read.busy & read.conditions.peers_spinning & ~read.clocks_cut & ~read.victim & ~idling
    # The group's noise is its spread beyond the capped offsets, as it was before any role was learned.
    spread = group_spread(tick.groups, read.deviation - nan_to_zero(state.offset), slots.group_of)[1]
    learn(state, cfg, read.deviation, tick.levels[: PW + 1], steady, waiting, read.conditions.one_job, spread)


def add_shared_node(tick: Tick, slots: Slots, judged: Judged, culprits: Culprits, shared: SharedNode) -> Culprits:
    """The culprits less those of groups that stand out all at once (two jobs mixed), plus shared_node's."""
    standing = judged.by_baseline & culprits.weak & slots.in_group
    named = culprits.named & ~mixed_fallback(tick, standing, slots.group_of)
    return replace(
        culprits,
        named=named | shared.on[0],
        weak=culprits.weak | shared.on[1],
        waiting=culprits.waiting | shared.waiting,
    )


@dataclass(frozen=True, slots=True)
class Sighting:
    """What the later stages read: the tick, the detector's state, and the stages' results so far
    (culprits with shared_node's added)."""

    tick: Tick
    state: StragglerState
    slots: Slots
    read: Readings
    judged: Judged
    culprits: Culprits


def standout_groups(seen: Sighting, shared: SharedNode) -> set[int]:
    """Groups where a GPU stands out at the weaker margins beyond its group's noise (or by clocks, bits,
    idling or on a shared node): they hold back the workload alerts."""
    tick, slots, read, judged, culprits = seen.tick, seen.slots, seen.read, seen.judged, seen.culprits
    ex = read.excess
    activity = np.where(read.sm_unknown, ex[PW], ex[SM])
    sigmas = excess_in_noise(seen.state, tick.config, tick.groups, activity, slots.group_of, slots.in_group)
    noise_inputs = {**judged.rule_inputs, "excess_sigmas": sigmas}
    beyond_noise = any_of(evaluate(BEYOND_NOISE, noise_inputs, tick.config), _names(BEYOND_NOISE))
    by_hardware = (culprits.hardware[1] | read.clocks_cut) & ~read.victim
    beyond = by_hardware | judged.idle[1] | shared.on[1] | beyond_noise
    return set(slots.gid[judged.by_baseline & culprits.weak & beyond].tolist())


def peers_still_waiting(read: Readings, judged: Judged, culprits: Culprits) -> np.ndarray:
    """Per slot: its peers still wait, or it still stands out cross-section at the weaker margin while
    they spin (an alert without a baseline to drop from holds on that)."""
    return culprits.waiting | judged.cross_plain[1] & read.conditions.peers_spinning


@dataclass(frozen=True, slots=True)
class NodeCulprits:
    """Nodes holding their group back, and the GPUs still named on their own."""

    findings: list[Finding]
    standout: set[tuple[int, int]]  # (group, node) pairs standing out at the weaker margins
    idle_groups: set[int]  # groups where someone stands out by idling on its host
    pairs: dict[str, tuple[int, int]]  # a node alert's fingerprint -> its (group, node)
    gpus_named: np.ndarray  # per slot: the GPUs named on their own


def find_nodes(seen: Sighting, still_waiting: np.ndarray, halted: AbstractSet[int]) -> NodeCulprits:
    """Nodes holding their group back (node_level), and nodes most of whose GPUs stand out (whole_node);
    no GPU of a group with such a node is named on its own."""
    tick, state, slots, read, judged, culprits = (
        seen.tick,
        seen.state,
        seen.slots,
        seen.read,
        seen.judged,
        seen.culprits,
    )
    findings, standout, idle_groups, pairs = node_level(tick, state, halted)
    idle_groups |= set(slots.gid[(judged.by_baseline | judged.by_cross_section) & judged.idle[1]].tolist())
    named = culprits.named
    # A GPU of its job standing out far above its peers by the cross-section, alone on its node and on
    # another node than those standing out, is named still: a node busier by role (the last pipeline stage)
    # stands out at the weaker margins once its job waits on that GPU. Several on one node are a node's
    # GPUs spinning at full clocks beside a capped or braked node: its victims.
    apart = named & judged.by_cross_section & judged.cross_plain[0]
    node_of = tick.windows.slot_node_id[: slots.n]
    if apart.any():
        key = slots.group_of * len(tick.windows.node_names) + node_of
        apart &= np.bincount(key[apart], minlength=int(key.max()) + 1)[key] == 1
    for gid, nid in standout:
        named = named & ((slots.gid != gid) | (apart & (node_of != nid)))
    # Most of a node's GPUs standing out together is judged at the weaker margins, cross-section too.
    cross_weak = (read.busy & judged.cross_plain[1]) | judged.by_cross_section
    cross_weak &= read.conditions.cross_steady
    weak = (judged.by_baseline | cross_weak) & still_waiting & culprits.weak
    whole_findings, whole_standout, whole_pairs, named = whole_node(tick, state, named, weak, judged.idle[0])
    standout |= whole_standout
    pairs.update(whole_pairs)
    return NodeCulprits(findings + whole_findings, standout, idle_groups, pairs, named)
