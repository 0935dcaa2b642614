"""Health kinds through the engine: node_unreachable, gpu_lost, xid, ecc."""

from __future__ import annotations

from gpufleet.server.engine.detectors.health import XID_MEANINGS
from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines


def _of(kind, override, seconds=900.0, nodes=2):
    return [a for a in run_replay(cluster_lines(seconds, nodes=nodes, override=override)) if a.kind.value == kind]


def test_silent_node_is_unreachable_and_resolves_when_samples_resume():
    def down(t, node, gpu):
        return {"_absent": True} if node == "n1" and 300 <= t < 480 else {}

    (a,) = _of("node_unreachable", down)
    assert a.node == "n1" and a.gpu is None and a.severity.value == "critical"
    assert T0 + 325 <= a.started <= T0 + 345
    assert T0 + 480 <= a.resolved <= T0 + 500


def test_brief_gap_is_not_unreachable():
    def gap(t, node, gpu):
        return {"_absent": True} if node == "n1" and 300 <= t < 315 else {}

    assert _of("node_unreachable", gap) == []


def test_gpu_reporting_down_is_lost():
    def lost(t, node, gpu):
        return (
            {"up": False, "utilization_ratio": None, "sm_active_ratio": None}
            if (node, gpu) == ("n0", 5) and t >= 400
            else {}
        )

    (a,) = _of("gpu_lost", lost)
    assert (a.node, a.gpu, a.resolved) == ("n0", 5, None)


def test_gpu_lost_seconds_before_its_node_falls_silent_is_lost_at_once():
    # Sampled every second: the GPU's last samples report up=false in a 5 s bin it began up, then the
    # whole node goes quiet (XID 79 can hang the host's agent too) and returns minutes later.
    def lost_then_silent(t, node, gpu):
        if node == "n0" and 405 <= t < 700:
            return {"_absent": True}
        return (
            {"up": False, "utilization_ratio": None, "sm_active_ratio": None}
            if (node, gpu) == ("n0", 5) and t >= 403
            else {}
        )

    (a,) = [
        a
        for a in run_replay(cluster_lines(900.0, interval=1.0, override=lost_then_silent))
        if a.kind.value == "gpu_lost"
    ]
    assert (a.node, a.gpu, a.resolved) == ("n0", 5, None)
    assert a.started <= T0 + 410, f"fired at +{a.started - T0:.0f}s, when the node came back"


def test_gpu_vanishing_from_its_node_is_lost():
    def gone(t, node, gpu):
        return {"_absent": True} if (node, gpu) == ("n1", 2) and t >= 400 else {}

    (a,) = _of("gpu_lost", gone)
    assert (a.node, a.gpu) == ("n1", 2) and a.evidence["missing"] is True


def test_xid_increase_fires_with_code_and_meaning_and_survives_counter_reset():
    def xid(t, node, gpu):
        if (node, gpu) != ("n0", 1):
            return {}
        if t < 300:
            return {"xid_errors_total": 5, "last_xid": 13}
        if t < 400:
            return {"xid_errors_total": 0, "last_xid": None}  # agent restart: counter reset
        return {"xid_errors_total": 2, "last_xid": 79, "xid_errors_by_code": {79: 2}}

    alerts = _of("xid", xid)
    assert [(a.gpu, a.evidence["code"]) for a in alerts] == [(1, 79)]
    assert alerts[0].evidence["meaning"] == XID_MEANINGS[79]
    assert alerts[0].severity.value == "critical"
    assert T0 + 400 <= alerts[0].started <= T0 + 410


def test_uncorrected_ecc_and_pending_remap_fire_ecc():
    def ecc(t, node, gpu):
        if (node, gpu) == ("n1", 7) and t >= 300:
            return {"ecc_uncorrected_errors_total": 3, "remapped_rows_pending": True}
        return {}

    (a,) = _of("ecc", ecc)
    assert (a.node, a.gpu, a.resolved) == ("n1", 7, None)
    assert a.evidence["remapped_rows_pending"] is True


def test_pending_remap_holds_one_alert_through_bins_without_a_sample():
    # Sampled every 10 s against 5 s ticks, and at 5 s with lines lost: a bin without the GPU's sample
    # says nothing about its remap; the alert resolves only once a sample shows the remap done.
    def remap(t, node, gpu):
        if (node, gpu) != ("n1", 7) or t < 300:
            return {}
        if 400 <= t < 430 and t % 10 == 5:
            return {"_absent": True}
        return {"remapped_rows_pending": t < 600}

    for interval in (5.0, 10.0):
        lines = cluster_lines(900.0, interval=interval, nodes=2, override=remap)
        (a,) = [a for a in run_replay(lines) if a.kind.value == "ecc"]
        assert (a.node, a.gpu) == ("n1", 7)
        assert T0 + 300 <= a.started <= T0 + 310 and T0 + 600 <= a.resolved <= T0 + 615, interval


def test_ecc_summary_counts_what_its_evidence_counts_with_the_right_plural():
    # One uncorrected error, then a second while the alert fires: the summary follows the evidence's figure.
    def ecc(t, node, gpu):
        if (node, gpu) != ("n1", 7) or t < 300:
            return {}
        return {"ecc_uncorrected_errors_total": 1 if t < 400 else 2}

    def first_error_only(t, node, gpu):
        return ecc(t, node, gpu) and {"ecc_uncorrected_errors_total": 1}

    (one,) = _of("ecc", first_error_only)
    assert one.evidence["uncorrected_errors_new"] == 1
    assert one.summary == "GPU 7 on n1: 1 uncorrected ECC error"
    (two,) = _of("ecc", ecc)
    assert two.started < T0 + 400, "the second error must come while the alert fires"
    assert two.evidence["uncorrected_errors_new"] == 2
    assert two.summary == "GPU 7 on n1: 2 uncorrected ECC errors"
    assert T0 + 400 <= two.evidence["last_error_time"] <= T0 + 410


def test_an_ecc_alert_reads_the_same_as_it_fires_and_after_whatever_the_trace_length():
    """Live sends the summary as it fires; the pages and replay show it later. Between errors a remap still
    pending kept the alert on and its summary lost the error count: the two read differently."""

    def ecc(t, node, gpu):
        if (node, gpu) == ("n1", 7) and t >= 300:
            return {"ecc_uncorrected_errors_total": 3, "remapped_rows_pending": True}
        return {}

    summaries = {a.summary for seconds in (310.0, 320.0, 900.0) for a in _of("ecc", ecc, seconds=seconds)}
    assert summaries == {"GPU 7 on n1: 3 uncorrected ECC errors, row remapping pending (reset needed)"}
