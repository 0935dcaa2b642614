"""comm_bound / input_bound through the engine."""

from __future__ import annotations

from server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines


def _kinds(lines):
    return sorted((a.kind.value, a.hpc_job, a.node, a.gpu) for a in run_replay(lines))


def test_job_wide_activity_drop_with_high_utilization_is_comm_bound():
    def comm(t, node, gpu):
        return {"sm_active_ratio": 0.55, "power_watts": 400.0} if 400 <= t < 700 else {}

    alerts = run_replay(cluster_lines(900, override=comm))
    assert _kinds(cluster_lines(900, override=comm)) == [("comm_bound", "j1", None, None)]
    (a,) = alerts
    assert T0 + 400 < a.started <= T0 + 460 and a.resolved is not None
    assert a.evidence["baseline"] > a.evidence["current"]
    assert 0.25 < a.evidence["drop_ratio"] < 0.4


def test_utilization_falling_job_wide_is_input_bound():
    def starved(t, node, gpu):
        return {"utilization_ratio": 0.6, "sm_active_ratio": 0.5, "power_watts": 350.0} if t >= 400 else {}

    assert _kinds(cluster_lines(800, override=starved)) == [("input_bound", "j1", None, None)]


def test_comm_bound_on_power_where_sm_activity_is_unsupported():
    def comm(t, node, gpu):
        kw = {"sm_active_ratio": None}
        if t >= 400:
            kw["power_watts"] = 380.0
        return kw

    assert _kinds(cluster_lines(800, override=comm)) == [("comm_bound", "j1", None, None)]


def test_short_checkpoint_pause_is_not_an_alert():
    def pause(t, node, gpu):
        return {"utilization_ratio": 0.1, "sm_active_ratio": 0.05, "power_watts": 150.0} if 400 <= t < 415 else {}

    assert _kinds(cluster_lines(800, override=pause)) == []
