"""Uneven ranks through the engine: a GPU steadily busier than its peers by its role (a pipeline's last
stage) is no straggler when its job waits, while a change from its own normal still is."""

from __future__ import annotations

import numpy as np

from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines

# The last pipeline stage: two GPUs of n1 doing 20 % more work per step than the other ranks.
LAST_STAGE = {("n1", 6), ("n1", 7)}
ROLE = 1.20
SM, POWER = 0.80, 500.0
# From here on the job waits for a culprit: every other rank's activity falls to this share, the last
# stage's with the rest (each does its step's work in a longer step), still within its own usual level
# as far as a culprit keeps (straggler_sm_kept_ratio).
WAIT_S, WAIT_END_S, WAITING = 600.0, 900.0, 0.88


def _noisy(override, spread: float = 0.01, seed: int = 7):
    """The trace with every running GPU's SM activity and power off by its own independent noise of
    about `spread` (each sample a fresh draw): what sets no GPU apart, and what the margins must rise above."""
    rng = np.random.default_rng(seed)
    draws: dict[tuple[float, str, int], float] = {}

    def patched(t, node, gpu):
        kw = dict(override(t, node, gpu))
        noise = draws.setdefault((t, node, gpu), float(1.0 + rng.normal(0.0, spread)))
        kw["sm_active_ratio"] = kw.get("sm_active_ratio", SM) * noise
        kw["power_watts"] = kw.get("power_watts", POWER) * noise
        return kw

    return patched


def _pipeline(culprit: tuple[str, int]):
    """A job whose last stage is busier by role; from WAIT_S to WAIT_END_S `culprit` keeps its own
    activity while every other rank waits for it (the last stage's role holding: it waits as much)."""

    def override(t, node, gpu):
        role = ROLE if (node, gpu) in LAST_STAGE else 1.0
        waits = WAIT_S <= t < WAIT_END_S and (node, gpu) != culprit
        share = WAITING if waits else 1.0
        return {"sm_active_ratio": SM * role * share, "power_watts": POWER * role * share}

    return override


def _stragglers(lines):
    return [a for a in run_replay(lines) if a.kind.value == "straggler"]


def test_a_busier_pipeline_stage_is_not_named_while_its_job_waits_on_another_gpu():
    # The last stage reads 20 % above its peers throughout; with offsets capped at 5 % that read as a
    # culprit's 15 % excess whenever the job waited. Only the GPU that kept its pace is named.
    alerts = _stragglers(cluster_lines(1200, override=_noisy(_pipeline(("n0", 2)))))
    assert [(a.node, a.gpu) for a in alerts] == [("n0", 2)]
    assert T0 + WAIT_S < alerts[0].started <= T0 + WAIT_S + 90


def test_a_pipeline_stage_that_slows_beyond_its_role_is_named():
    # The same stage GPU keeping its own pace while every other rank waits: a change from its own normal
    # (its role), named; its stage mate, which waits like everyone else, is not.
    alerts = _stragglers(cluster_lines(1200, override=_noisy(_pipeline(("n1", 7)))))
    assert [(a.node, a.gpu) for a in alerts] == [("n1", 7)]
    ev = alerts[0].evidence
    # Its excess is read beyond its role, not beyond the capped structural offset.
    assert (
        ev["excess_vs_own_baseline"]["sm_active"]
        < ev["sm_active_ratio"] / ev["peer_median_sm_active_ratio"] - ROLE + 0.02
    )


def test_the_role_is_not_learned_while_the_job_waits():
    # A role is learned only over unslowed running: a GPU that became a culprit is never absorbed, so a
    # long wait keeps it named to the end (a role learning through the wait would clear it).
    alerts = _stragglers(cluster_lines(1200, override=_noisy(_pipeline(("n0", 2)))))
    (a,) = alerts
    assert a.resolved is not None and a.resolved >= T0 + WAIT_END_S


def _two_noisy_nodes(slow_node: str | None, seed: int):
    """Two nodes of 4 GPUs that report no SM activity, sampled every 10 s, each GPU's power off by its
    own 10 % noise each sample (a node's median over 4 such is noisy); from WAIT_S to WAIT_END_S the job
    waits, for `slow_node` where given (it keeps its power while the other node's falls by a fifth)."""
    rng = np.random.default_rng(seed)
    draws: dict[tuple[float, str, int], float] = {}

    def override(t, node, gpu):
        share = 0.80 if WAIT_S <= t < WAIT_END_S and node != slow_node else 1.0
        noise = draws.setdefault((t, node, gpu), float(1.0 + rng.normal(0.0, 0.10)))
        return {"sm_active_ratio": None, "power_watts": 400.0 * share * noise}

    return override


def test_a_node_within_its_usual_wander_is_not_named_while_a_slow_node_is():
    # With a fixed 5 % power margin either node's noisy median stood out by turns whenever the job was
    # judged waiting; the margin widens to the pair's own wander against the other node.
    for seed in (1, 2, 3):
        assert _stragglers(cluster_lines(1200, interval=10.0, gpus=4, override=_two_noisy_nodes(None, seed))) == []
        alerts = _stragglers(cluster_lines(1200, interval=10.0, gpus=4, override=_two_noisy_nodes("n1", seed)))
        assert [(a.node, a.gpu) for a in alerts] == [("n1", None)]
        assert T0 + WAIT_S < alerts[0].started <= T0 + WAIT_S + 90


def test_role_mates_pairs_roles_within_the_range_inside_each_group_and_row():
    from gpufleet.server.engine.detectors.straggler.gpus import role_mates

    nan = np.nan
    gid = np.array([0, 0, 0, 1, 1, -1, -1, 1])
    role = np.array(
        [
            [0.00, 0.05, 0.30, 0.10, 0.10, 0.00, 0.00, nan],  # SM: 0 and 1 close, 2 alone; 3 and 4 tie
            [0.20, 0.00, 0.21, 0.10, 0.50, 0.20, 0.20, 0.45],  # power: 0 and 2 close; 4 and 7; no group: none
        ]
    )
    mates = role_mates(role, gid, 0.06)
    assert mates.tolist() == [
        [True, True, False, True, True, False, False, False],
        [True, False, True, False, True, False, False, True],
    ]
    # Rows are apart: a GPU of no group in the power row is no mate of the last group's GPU in the SM row.
    assert not role_mates(np.array([[0.0, nan], [nan, 0.0]]), np.array([1, -1]), 1.0).any()
