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

import dataclasses
import math

import numpy as np

from gpufleet.server.engine.detectors import Context, Finding, Outcome
from gpufleet.server.engine.detectors.straggler.gpu_finding import gpu_finding
from gpufleet.server.engine.detectors.straggler.policy import RULES
from gpufleet.server.engine.detectors.straggler.stages import (
    Judged,
    NodeCulprits,
    Readings,
    Sighting,
    add_shared_node,
    add_steps,
    find_culprits,
    find_nodes,
    find_shared_node,
    peers_still_waiting,
    judge,
    learn_offsets,
    place_gpus,
    read_gpus,
    standout_groups,
)
from gpufleet.server.engine.detectors.straggler.gpus import SharedNode
from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.detectors.straggler.steps import Steps
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
    state.fit(tick.windows.n)
    state.note_link_retries(context.events, tick.t, tick.config.window_seconds)
    if tick.groups.n_groups == 0:
        return Result(Outcome(), set(), set())
    slots = place_gpus(tick, state)
    read = read_gpus(tick, state, slots, context.halted)
    judged = judge(tick, state, slots, read)
    culprits, steps = add_steps(
        tick, state, slots, read, find_culprits(tick, state, slots, read, judged), context.halted
    )
    shared = find_shared_node(tick, state, slots, read)
    held = culprits.named | culprits.unwaited | shared.on[0]
    learn_offsets(tick, state, slots, read, culprits.waiting | shared.waiting, held)
    seen = Sighting(tick, state, slots, read, judged, add_shared_node(tick, slots, judged, culprits, shared))
    standout = standout_groups(seen, shared)
    still_waiting = peers_still_waiting(read, judged, seen.culprits)
    nodes = find_nodes(seen, still_waiting, context.halted)
    out = Outcome()
    for finding in _gpu_findings(tick, state, read, judged, nodes, shared, steps):
        out.add(finding)
    for finding in nodes.findings:
        out.add(finding)
    standout |= {gid for gid, _ in nodes.standout}
    out.clear = _clear_test(seen, still_waiting, nodes)
    state.prune(tick.t, tick.config.straggler_cost_keep_seconds)
    return Result(out, standout, nodes.idle_groups, frozenset(slots.gid[nodes.gpus_named].tolist()))


def _gpu_findings(
    tick: Tick,
    state: StragglerState,
    read: Readings,
    judged: Judged,
    nodes: NodeCulprits,
    shared: SharedNode,
    steps: Steps,
) -> list[Finding]:
    """A finding for each GPU named on its own, held since it stood out in every newest reading."""
    since = state.standing_since
    return [
        _held_since(
            gpu_finding(
                tick,
                state,
                slot,
                read.excess[:, slot],
                read.deviation[:, slot],
                bool(judged.cross[slot]),
                bool(judged.idle[0, slot]),
                shared if shared.on[0, slot] else None,
                _step(steps, slot),
            ),
            float(since[slot]) if slot < len(since) else math.nan,
        )
        for slot in nodes.gpus_named.nonzero()[0].tolist()
    ]


def _step(steps: Steps, slot: int) -> tuple[float, float, bool] | None:
    """A GPU's step found (its rise, its peers' fall, whether against its node's GPUs), None: none."""
    if not steps.on[slot]:
        return None
    by_node = steps.by_node is not None and bool(steps.by_node[slot])
    return float(steps.size[slot]), float(steps.fall[slot]), by_node


def _held_since(finding: Finding, since: float) -> Finding:
    """The finding with its held_since (none where the GPU does not stand out in its newest reading)."""
    return finding if math.isnan(since) else dataclasses.replace(finding, held_since=since)


def _clear_test(seen: Sighting, still_waiting: np.ndarray, nodes: NodeCulprits):
    """Clear once the GPU no longer stands out even at reduced margins, its group stopped waiting (even
    at the reduced cross-sectional margin: peers_still_waiting) or went idle, or it left the job.

    Before the GPU has learned or its group's slowdown is measured (a straggler from the job's start
    keeps both from forming), only the cross-section clears it: the GPU no longer stands out.
    """
    tick, state, slots, read, judged = seen.tick, seen.state, seen.slots, seen.read, seen.judged
    w, index = tick.windows, state.index
    node_pairs, node_standout = nodes.pairs, nodes.standout
    in_judged = (read.busy | judged.starved) & read.conditions.active
    warm = (state.learned[: slots.n] >= read.warm_ticks) & read.conditions.slowdown_measured
    weak, cross = seen.culprits.weak, judged.cross

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
        if not in_judged[slot]:
            return True
        if not warm[slot]:
            return not (weak[slot] or cross[slot])
        return not (still_waiting[slot] and weak[slot])

    return test
