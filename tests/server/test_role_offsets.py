"""A rank steadily different by role from the job's start (a pipeline's last stage) learns its offset
beyond the structural range; a straggler slow from the start, whose peers wait for it, does not hide so."""

from __future__ import annotations

from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines

# The last stage, GPUs n1/6 and n1/7, does 20 % more work per step than the others from the job's start.
_STAGE = {"sm_active_ratio": 0.96, "power_watts": 560.0}


def _stragglers(lines, config=None):
    return [a for a in run_replay(lines, config) if a.kind.value == "straggler"]


def _pipeline(straggler_from_s: float | None = None):
    def override(t, node, gpu):
        stage = node == "n1" and gpu >= 6
        if straggler_from_s is None or not straggler_from_s <= t < straggler_from_s + 400:
            return dict(_STAGE) if stage else {}
        # GPU n0/2 turns 14 % slow: it computes on while everyone, the last stage too, waits for it.
        if (node, gpu) == ("n0", 2):
            return {"sm_active_ratio": 0.80, "power_watts": 500.0}
        return {"sm_active_ratio": 0.84 if stage else 0.70, "power_watts": 520.0 if stage else 450.0}

    return override


def test_a_busier_last_stage_all_along_is_no_straggler():
    assert _stragglers(cluster_lines(1800, override=_pipeline())) == []


def test_a_straggler_in_a_pipeline_job_is_named_and_the_busier_stage_is_not():
    # With the stage's offset held to the structural 5 %, its 15 % beyond that stood out too while the
    # job slowed for the real straggler.
    (s,) = _stragglers(cluster_lines(1200, override=_pipeline(400.0)))
    assert (s.node, s.gpu) == ("n0", 2) and T0 + 400 < s.started <= T0 + 520


def test_the_stage_itself_turning_slow_is_named_against_its_role():
    # The last stage's GPU n1/7 keeps its 20 % more activity while from +400 s every other rank waits
    # for it: a change from its own role, so it is named although its role was learned.
    def override(t, node, gpu):
        if (node, gpu) == ("n1", 7):
            return dict(_STAGE)
        if not 400 <= t < 800:
            return dict(_STAGE) if node == "n1" and gpu == 6 else {}
        return {"sm_active_ratio": 0.70, "power_watts": 430.0}

    (s,) = _stragglers(cluster_lines(1100, override=override))
    assert (s.node, s.gpu) == ("n1", 7) and T0 + 400 < s.started <= T0 + 520


def test_a_straggler_from_the_start_is_not_learned_as_a_role_once_its_peers_wait():
    # GPU n1/3 is 25 % busier than its peers from +30 s: while it warms up that looks like a role, but
    # its peers' activity fell from the job's first pace (0.80) to 0.64 and no GPU explains that beyond
    # its role: it is judged beyond the structural range, and named.
    def slowed(t, node, gpu):
        if not 30 <= t < 600:
            return {}
        if (node, gpu) == ("n1", 3):
            return {"power_watts": 510.0}
        return {"sm_active_ratio": 0.64, "power_watts": 440.0}

    (s,) = _stragglers(cluster_lines(900, override=slowed))
    assert (s.node, s.gpu) == ("n1", 3) and s.resolved is not None
