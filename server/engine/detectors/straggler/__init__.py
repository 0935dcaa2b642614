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

import numpy as np

from gpufleet.server.engine.detectors import Context, FingerprintIndex, Outcome
from gpufleet.server.engine.detectors.straggler.common import PW, SM, UTIL, scales
from gpufleet.server.engine.detectors.straggler.gpus import (
    cuts,
    deviation,
    excess_in_noise,
    gpu_finding,
    group_conditions,
    group_spread,
    learned_noise,
    learn,
    mixed_fallback,
    reset_moved,
    shared_node,
    signals,
    standing_now,
)
from gpufleet.server.engine.detectors.straggler.nodes import node_level, whole_node
from gpufleet.server.engine.detectors.straggler.policy import BEYOND_NOISE, CROSS_SECTION, RANK_IDLE, RULES
from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.reduce import nan_to_zero
from gpufleet.server.engine.rules import any_of, evaluate
from gpufleet.server.engine.tick import Tick

__all__ = ["RULES", "Result", "StragglerState", "detect"]


class Result:
    """Straggler outcome plus which groups have someone standing out (suppresses comm_bound), and which
    have someone standing out by idling below their peers (suppresses input_bound too)."""

    def __init__(
        self,
        outcome: Outcome,
        standout_groups: set[int],
        idle_groups: set[int],
        named_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.outcome = outcome
        self.standout_groups = standout_groups
        self.idle_groups = idle_groups
        self.named_groups = named_groups  # groups with a GPU named this tick


def detect(tick: Tick, state: StragglerState, context: Context) -> Result:
    """GPU-level and node-level straggler findings for this tick (none in the context's halted groups: a
    job hung by a lost GPU has no straggler among the GPUs left)."""
    halted = context.halted
    cfg = tick.config
    n = tick.windows.n
    state.fit(n)
    if tick.groups.n_groups == 0:
        return Result(Outcome(), set(), set())
    grp = tick.groups
    g = grp.gid
    carried = tick.registry.carried
    if len(carried) < n:
        carried = np.concatenate([carried, np.zeros(n - len(carried), dtype=bool)])
    reset_moved(state, cfg, g, carried, (g >= 0) & tick.registry.one_job[np.maximum(g, 0)])
    m = tick.med
    u = m["util"]
    in_group = g >= 0
    gi = np.where(in_group, g, 0)
    peers = grp.levels[:, gi]  # each slot's group medians
    gsm = peers[SM]
    dev = deviation(tick.levels, peers)
    (group_ok, cross_ok, dropped, wait_util, active, in_job, measured) = (
        group_conditions(tick, state, cfg, halted)[:, gi] & in_group
    )
    # Judged once learned (before this tick's learning): its offsets and usual levels mean something. The
    # startup grace's learning also forgets a job's ramp-up. A group already running when first seen has
    # none, so there a share of it suffices (straggler_running_grace_ratio). A rank of a
    # trace recorded mid-job that idled on its host from +60 s had learned 55 s, and it never learns
    # while it idles: it was never judged, and its job read as comm_bound.
    warm_ticks = np.where(
        tick.registry.dated[gi] & in_group,
        cfg.bins(cfg.startup_grace_seconds * cfg.straggler_running_grace_ratio),
        cfg.bins(cfg.startup_grace_seconds),
    )
    busy = (u >= cfg.busy_utilization) & in_group
    judged_ok = (state.learned[:n] >= warm_ticks) & group_ok
    eligible = busy & judged_ok
    gslow = grp.slow[gi]
    cut, victim = cuts(tick, cfg, dev, gslow, gi, in_group)
    ex = dev - nan_to_zero(state.offset)
    both = scales(cfg)
    gsm_unknown = np.isnan(gsm)
    # One rank waiting on its own host (a slow input pipeline, extra host-side work on rank 0, a checkpoint
    # written by rank 0 alone) idles while its peers spin in the collective at full utilization:
    # utilization below theirs, beyond its learned offset, is the culprit direction too. Only within a job:
    # an unattributed GPU idling more than its node's others may just run other work. A GPU that was never
    # warm (idle or far below its peers from the start) is judged by the cross-section alone, a gap of
    # twice the margin as for activity, and only while it computes at all: a GPU of the allocation the
    # job never uses holds nobody back.
    starved = in_job & ~victim
    noise = learned_noise(state, cfg, n)
    arrays = {
        "sm_excess": ex[SM],
        "power_excess": ex[PW],
        "idle_excess": -ex[UTIL],
        "idle_gap": -dev[UTIL],
        "sm_spread": noise[SM],
        "power_spread": noise[PW],
        "idle_spread": noise[UTIL],
        "starved": starved,
        "computing": u >= cfg.job_active_utilization,
        "in_job": in_job,
        "sm_supported": ~gsm_unknown,
        "sm_unsupported": gsm_unknown,
    }
    held = evaluate(RANK_IDLE + CROSS_SECTION, arrays, cfg, both)
    idle_cross = held["straggler_rank_idle_cross"][0]
    idle = any_of(held, [r.name for r in RANK_IDLE])
    eligible |= idle[1] & judged_ok
    # Peers at high utilization far below one GPU's activity are spinning, i.e. waiting for it,
    # even when the job never had a healthy baseline (a straggler from the start).
    plain = any_of(held, [r.name for r in CROSS_SECTION])
    # A clock cut is the GPU's own hardware slowing it, whatever runs beside it: it counts in a fallback
    # group too. Nothing is learned from a cut GPU, so one braked before its learning was done (a brake in
    # the first minutes of a trace that starts mid-job) was never judged at all without attribution.
    cross = (plain[0] | in_job & idle_cross) | cut & in_group
    eligible_cross = ((busy & cross) | idle_cross) & cross_ok
    # An inferred job is held to a stricter standard: its membership is a reading of co-movement, and a GPU
    # of another job that moved with it for a while (two jobs ramping up together) stands out at once by
    # the other job's level. There the cross-section names only a GPU that has stayed in the group for its
    # learning (a GPU's learning restarts when it joins another group), or one whose clocks are cut: its
    # own hardware slows it, whoever its peers are.
    inferred = (tick.registry.one_job & ~tick.registry.is_job)[: grp.n_groups][gi] & in_group
    eligible_cross &= ~inferred | (state.learned[:n] >= warm_ticks) | cut
    waiting = (dropped | cross) & wait_util
    culprit, other = signals(cfg, ex, tick.levels[: PW + 1], state, gsm_unknown, m["slow"], gslow)
    sig, weak = ((culprit | cut) & ~victim) | idle
    on = (eligible | eligible_cross) & waiting & sig
    on &= standing_now(tick, cfg, state, gi, gsm_unknown, on)
    # Offsets are learned only from GPUs doing what their peers do: not from one with its clocks cut (nor
    # from its full-clock peers meanwhile), nor from one idling well below its peers (a host-starved node)
    # - learned from those, the recovered GPU stood out in the culprit direction afterwards (an alert
    # that never cleared). Such a GPU is never warm either: a rank idling that much all along is judged
    # by the cross-section alone.
    idling = dev[UTIL] <= -cfg.node_idle_gap
    shared = shared_node(tick, cfg, state, gi, busy & (u >= cfg.straggler_waiting_utilization) & judged_ok, gsm_unknown)
    learn(
        state,
        cfg,
        dev,
        tick.levels[: PW + 1],
        busy & wait_util & ~cut & ~victim & ~idling,
        waiting | shared.waiting,
        in_job,
        group_spread(grp, ex, gi)[1],
    )
    on &= ~mixed_fallback(tick, eligible & weak & in_group, gi)
    on |= shared.on[0]
    weak = weak | shared.on[1]
    waiting = waiting | shared.waiting
    # Once open, an alert that only the cross-section backs (no baseline to drop from) holds while the
    # peers still read as waiting at the weaker margin: hovering at the doubled one, a straggler present
    # from the job's start was named, cleared and named again.
    cross_holding = plain[1]
    holding = waiting | cross_holding & wait_util
    out = Outcome()
    # Standing out by activity excess alone, within the noise of the group's excesses, holds nothing back.
    arrays["excess_sigmas"] = excess_in_noise(state, cfg, grp, np.where(gsm_unknown, ex[PW], ex[SM]), gi, in_group)
    noisy = any_of(evaluate(BEYOND_NOISE, arrays, cfg), [r.name for r in BEYOND_NOISE])
    beyond = ((other[1] | cut) & ~victim) | idle[1] | shared.on[1] | noisy
    standout = set(g[eligible & weak & beyond].tolist())
    node_findings, node_standout, idle_groups, node_pairs = node_level(tick, state, halted)
    idle_groups |= set(g[(eligible | eligible_cross) & idle[1]].tolist())
    # A node standing out as a whole explains its group's waiting: no GPU of that group is named.
    for gid, _ in node_standout:
        on &= g != gid
    # Whether most of a node's GPUs stand out together is judged at the holding margin for the cross-
    # section too. A node slow from the job's start, one of two in its job, had every GPU 9-15 % over
    # the job's power median, which sits between the two nodes: the three highest crossed the full
    # margin and one was named alone before the node was.
    cross_weak = ((busy & cross_holding) | eligible_cross) & cross_ok
    whole_findings, whole_standout, whole_pairs, on = whole_node(
        tick, state, on, (eligible | cross_weak) & holding & weak, idle[0]
    )
    named = frozenset(g[on].tolist())
    for slot in on.nonzero()[0].tolist():
        out.add(
            gpu_finding(
                tick,
                state,
                slot,
                ex[:, slot],
                dev[:, slot],
                bool(cross[slot]),
                bool(idle[0, slot]),
                shared if shared.on[0, slot] else None,
            )
        )
    for f in node_findings + whole_findings:
        out.add(f)
    node_standout |= whole_standout
    node_pairs.update(whole_pairs)
    standout |= {gid for gid, _ in node_standout}
    judged = (busy | starved) & active
    warm = (state.learned[:n] >= warm_ticks) & measured
    out.clear = _clear_test(tick, state.index, judged, warm, holding, weak, cross, node_pairs, node_standout)
    state.prune(tick.t, cfg.straggler_cost_keep_seconds)
    return Result(out, standout, idle_groups, named)


def _clear_test(
    tick: Tick,
    index: FingerprintIndex,
    judged: np.ndarray,
    warm: np.ndarray,
    holding: np.ndarray,
    weak: np.ndarray,
    cross: np.ndarray,
    node_pairs: dict[str, tuple[int, int]],
    node_standout: set[tuple[int, int]],
):
    """Clear once the GPU no longer stands out even at reduced margins, its group stopped waiting (even
    at the reduced cross-sectional margin: holding) or went idle, or it left the job.

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
        return not (holding[slot] and weak[slot])

    return test
