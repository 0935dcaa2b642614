"""Lifecycle rules with hand-made findings: for-durations, grace, hysteresis hold, restore."""

from __future__ import annotations

from gpufleet.server.alerts import AlertKind, AlertState, Severity
from gpufleet.server.engine.detectors import Finding, Outcome
from gpufleet.server.engine.lifecycle import Lifecycle

K = AlertKind.THERMAL_THROTTLE


def _f(severity=Severity.WARNING, **ev) -> Finding:
    return Finding(K, "n0", 1, "GPU-1", None, severity, "hot", {"temperature_celsius": 90, **ev})


def _step(lc, t, on, clear=None, severity=Severity.WARNING, **ev):
    out = Outcome(clear=lambda fp: clear)
    if on:
        out.add(_f(severity, **ev))
    return lc.step(t, {K: out})


def test_pending_then_firing_after_for_then_resolved_after_clear_hold():
    lc = Lifecycle({K: (30.0, 20.0)})
    (tr,) = _step(lc, 0, True)
    assert tr.previous is None and tr.alert.state is AlertState.PENDING
    assert _step(lc, 25, True) == []
    (tr,) = _step(lc, 30, True)
    assert (tr.previous, tr.alert.state, tr.alert.started) == (AlertState.PENDING, AlertState.FIRING, 30)
    assert _step(lc, 35, False, clear=True) == []
    assert _step(lc, 40, False, clear=False) == []  # in the hysteresis band: the hold restarts
    assert _step(lc, 45, False, clear=True) == []
    (tr,) = _step(lc, 65, False, clear=True)
    assert tr.alert.state is AlertState.RESOLVED and tr.alert.resolved == 65 and tr.alert.started == 30
    assert lc.alerts() == []


def test_pending_is_dropped_when_clear_and_kept_without_data():
    lc = Lifecycle({K: (30.0, 0.0)}, pending_grace=10.0)
    _step(lc, 0, True)
    assert _step(lc, 5, False, clear=None) == []  # no data: keep
    assert _step(lc, 10, False, clear=False) == []  # within grace
    (tr,) = _step(lc, 20, False, clear=False)  # grace exceeded
    assert tr.previous is AlertState.PENDING and tr.alert.started is None


def test_ticks_off_within_the_pending_grace_do_not_count_towards_for():
    # Two brief spells 10 s apart are not one condition held for 30 s: the grace keeps the pending
    # alert, and `for` counts only the ticks the condition held.
    lc = Lifecycle({K: (30.0, 0.0)}, pending_grace=10.0)
    _step(lc, 0, True)
    _step(lc, 5, True)
    assert _step(lc, 10, False, clear=False) == []  # off for one tick, within grace
    for t in (15, 20, 25, 30):
        assert _step(lc, t, True) == []  # held 25 s of the 30 s since it opened
    (tr,) = _step(lc, 35, True)
    assert tr.alert.state is AlertState.FIRING and tr.alert.started == 35 and tr.alert.pending_since == 0
    # "No data" counts neither way: it is not the condition going off.
    lc = Lifecycle({K: (30.0, 0.0)}, pending_grace=10.0)
    _step(lc, 0, True)
    assert _step(lc, 15, False, clear=None) == []
    (tr,) = _step(lc, 30, True)
    assert tr.alert.state is AlertState.FIRING


def test_zero_for_fires_at_once_and_severity_escalation_is_reported():
    lc = Lifecycle({K: (0.0, 0.0)})
    (tr,) = _step(lc, 0, True)
    assert tr.previous is None and tr.alert.state is AlertState.FIRING
    (tr,) = _step(lc, 5, True, severity=Severity.CRITICAL)
    assert tr.previous is AlertState.FIRING and tr.alert.severity is Severity.CRITICAL


def test_firing_evidence_is_kept_but_running_tallies_update():
    lc = Lifecycle({K: (0.0, 0.0)})
    _step(lc, 0, True, gpu_hours_lost=1.0)
    _step(lc, 5, True, gpu_hours_lost=2.0, temperature_celsius=84)
    (a,) = lc.alerts()
    assert a.evidence["temperature_celsius"] == 90 and a.evidence["gpu_hours_lost"] == 2.0


def test_restore_keeps_id_and_started_and_dedups():
    lc = Lifecycle({K: (30.0, 0.0)})
    _step(lc, 0, True)
    _step(lc, 30, True)
    (open_alert,) = lc.alerts()
    fresh = Lifecycle({K: (30.0, 0.0)})
    assert fresh.restore([open_alert, open_alert]) == 1
    assert _step(fresh, 100, True) == []  # same fingerprint: no new alert
    (a,) = fresh.alerts()
    assert (a.id, a.started, a.state) == (open_alert.id, 30, AlertState.FIRING)


def test_restored_alert_is_not_rejudged_on_ticks_it_already_covers():
    lc = Lifecycle({K: (30.0, 20.0)})
    _step(lc, 0, True)
    _step(lc, 30, True)
    _step(lc, 100, True)
    (open_alert,) = lc.alerts()
    assert open_alert.updated == 100
    fresh = Lifecycle({K: (30.0, 20.0)})
    fresh.restore([open_alert])
    # Agents re-send their buffers after a restart: ticks from before the incident read clear.
    for t in range(40, 101, 5):
        assert _step(fresh, t, False, clear=True) == []
    (a,) = fresh.alerts()
    assert (a.id, a.state, a.updated) == (open_alert.id, AlertState.FIRING, 100)
    # Ticks after the stored update count as usual.
    assert _step(fresh, 105, False, clear=True) == []
    (tr,) = _step(fresh, 125, False, clear=True)
    assert tr.alert.state is AlertState.RESOLVED and tr.alert.id == open_alert.id and tr.alert.resolved == 125


def _held(since):
    return Finding(K, "n0", 1, "GPU-1", None, Severity.WARNING, "hot", {}, held_since=since)


def test_a_finding_held_unsmoothed_since_its_onset_fires_for_after_the_onset():
    # The smoothed finding first holds at 15 s; the newest bins showed it from 0 s: for counts from there.
    lc = Lifecycle({K: (30.0, 0.0)}, onset_lead={K: 15.0})
    for t in (15, 20, 25):
        assert all(tr.alert.state is AlertState.PENDING for tr in lc.step(t, {K: Outcome({"x": _held(0.0)})}))
    (tr,) = lc.step(30, {K: Outcome({"x": _held(0.0)})})
    assert tr.alert.state is AlertState.FIRING and tr.alert.started == 30 and tr.alert.pending_since == 15


def test_a_subject_standing_out_long_before_its_finding_waits_the_whole_for():
    # Unsmoothed since 0 s, but the finding first holds at 40 s: more than the lead later, so no change
    # began at 0 s that the finding confirms (a pipeline's busier last stage), and for counts from 40 s.
    lc = Lifecycle({K: (30.0, 0.0)}, onset_lead={K: 15.0})
    for t in range(40, 70, 5):
        assert all(tr.alert.state is AlertState.PENDING for tr in lc.step(t, {K: Outcome({"x": _held(0.0)})}))
    (tr,) = lc.step(70, {K: Outcome({"x": _held(0.0)})})
    assert tr.alert.state is AlertState.FIRING and tr.alert.started == 70


def test_a_run_begun_a_little_before_the_lead_counts_from_the_lead_where_the_kind_allows():
    # Pending at 30 s, lead 15 s: a run from 5 s began 10 s before the lead. Where the kind allows runs
    # that early (noise lit a bin or two before the change), for counts from 15 s and it fires at 45 s.
    lenient = Lifecycle({K: (30.0, 0.0)}, onset_lead={K: 15.0}, early_run={K: 15.0})
    strict = Lifecycle({K: (30.0, 0.0)}, onset_lead={K: 15.0})
    fired = {}
    for t in range(30, 65, 5):
        for name, lc in (("lenient", lenient), ("strict", strict)):
            for tr in lc.step(t, {K: Outcome({"x": _held(5.0)})}):
                if tr.alert.state is AlertState.FIRING:
                    fired[name] = tr.alert.started
    assert fired == {"lenient": 45, "strict": 60}


def test_a_run_begun_more_than_the_early_allowance_before_the_lead_waits_the_whole_for():
    lc = Lifecycle({K: (30.0, 0.0)}, onset_lead={K: 15.0}, early_run={K: 15.0})
    started = [
        tr.alert.started
        for t in range(40, 75, 5)
        for tr in lc.step(t, {K: Outcome({"x": _held(5.0)})})  # 20 s before the lead (25 s)
        if tr.alert.state is AlertState.FIRING
    ]
    assert started == [70]
