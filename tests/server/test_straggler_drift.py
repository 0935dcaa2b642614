"""A rank whose load drifts (mixture-of-experts routing) through the engine: it climbs above its peers as a
ramp over minutes and its job waits for it, which is no fault; the same GPU leaving its path at a moment
(a fault's step) is still named."""

from __future__ import annotations

import numpy as np

from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines

EXPERT = ("n0", 3)
SM, POWER = 0.70, 500.0
# The expert's work per step against its peers': even until RAMP_S, then up by RAMP_RISE over RAMP_SECONDS
# (a drift of 3 % a minute, as routing moves load over tens of minutes), then held there.
RAMP_S, RAMP_SECONDS, RAMP_RISE = 300.0, 300.0, 0.15
# The fault: from STEP_S the expert's work per step jumps by STEP_RISE on top of where it stood.
STEP_S, STEP_RISE = 780.0, 0.30
# A node's median of several experts moves less and slower than one: up by NODE_RISE over NODE_RAMP_SECONDS.
NODE_RISE, NODE_RAMP_SECONDS = 0.08, 600.0


def _drifting(step: bool, busier, rise: float, ramp_s: float, with_sm: bool, seed: int):
    """Readings of a job whose busier GPUs (busier(node, gpu)) take on `rise` more work over `ramp_s` from
    RAMP_S, and with `step` STEP_RISE more at STEP_S: each step lasts as long as the busier ranks' work, so
    the others wait (their activity and power fall to their share of the step) while the busier compute
    throughout. Every GPU's readings carry their own 1 % noise."""
    rng = np.random.default_rng(seed)
    draws: dict[tuple[float, str, int], float] = {}

    def override(t, node, gpu):
        work = 1.0 + rise * float(np.clip((t - RAMP_S) / ramp_s, 0.0, 1.0))
        if step and t >= STEP_S:
            work += STEP_RISE
        share = 1.0 if busier(node, gpu) else 1.0 / work
        noise = draws.setdefault((t, node, gpu), float(1.0 + rng.normal(0.0, 0.01)))
        return {"sm_active_ratio": SM * share * noise if with_sm else None, "power_watts": POWER * share * noise}

    return override


def _expert(step: bool):
    """The job: one expert (EXPERT) whose load drifts up by RAMP_RISE over RAMP_SECONDS."""
    return _drifting(step, lambda node, gpu: (node, gpu) == EXPERT, RAMP_RISE, RAMP_SECONDS, True, 11)


def _stragglers(lines):
    return [a for a in run_replay(lines) if a.kind.value == "straggler"]


def test_an_expert_whose_load_drifts_up_is_not_named_while_its_job_waits_for_it():
    # The expert ends 15 % above its peers and its job waits on it: beyond the 10 % margin over its own
    # learned offset, it was named. It got there along its own path, which follows it as it moves.
    assert _stragglers(cluster_lines(1200, override=_expert(step=False))) == []


def test_an_expert_leaving_its_path_at_a_moment_is_named():
    # The same drift, then a fault: the expert's work jumps at one moment, far from where its path had
    # followed it, and it is named soon after; the path stays where the fault left it while it is named.
    alerts = _stragglers(cluster_lines(1200, override=_expert(step=True)))
    assert [(a.node, a.gpu) for a in alerts] == [EXPERT]
    assert T0 + STEP_S < alerts[0].started <= T0 + STEP_S + 90
    assert alerts[0].resolved is None


def _expert_node(step: bool):
    """Two nodes of 4 GPUs that report no SM activity, sampled every 10 s: the experts on n0 take on load
    together (their median drifts up by NODE_RISE over NODE_RAMP_SECONDS), so n1's GPUs wait for them,
    their power falling to their share of each step; with `step`, n0's work jumps by STEP_RISE at STEP_S."""
    return _drifting(step, lambda node, gpu: node == "n0", NODE_RISE, NODE_RAMP_SECONDS, False, 5)


def test_a_node_whose_experts_load_drifts_up_is_not_named():
    # The node's median power ends 8 % above the other node's while that one waits: beyond the 5 % node
    # margin over its learned offset, it was named; it got there along its own path.
    lines = cluster_lines(1200, interval=10.0, gpus=4, override=_expert_node(step=False))
    assert _stragglers(lines) == []


def test_a_node_leaving_its_path_at_a_moment_is_named():
    lines = cluster_lines(1200, interval=10.0, gpus=4, override=_expert_node(step=True))
    alerts = _stragglers(lines)
    assert [(a.node, a.gpu) for a in alerts] == [("n0", None)]
    assert T0 + STEP_S < alerts[0].started <= T0 + STEP_S + 90
