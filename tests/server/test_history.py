"""The pages' chart history: what it reads from the engine's windows, its bounds, and that reading it
changes nothing the engine decides."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpufleet.server import history
from gpufleet.server.alerts import AlertKind, AlertState
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine
from gpufleet.server.history import ChartHistory, Downsampled, job_quantiles
from tests.server.engine_samples import T0, cluster_lines, slow_gpu_from_400


def _drive(lines, until: float, charts: ChartHistory | None, step: float = 5.0):
    """Feed an engine the lines up to `until` s, as the live server does, observing after each cycle."""
    eng = Engine()
    samples = sorted((parse_line(line) for line in lines), key=lambda s: s.time)
    i, t, transitions, out = 0, T0 + step, [], None
    while t <= T0 + until:
        while i < len(samples) and samples[i].time < t:
            eng.ingest(samples[i])
            i += 1
        transitions += eng.advance(t)
        if charts is not None:
            out = charts.observe(eng, eng.alerts())
        t += step
    return eng, transitions, out


@pytest.fixture(scope="module")
def straggling():
    lines = cluster_lines(560, override=slow_gpu_from_400)
    return _drive(lines, 560, ChartHistory())


def test_an_alert_chart_draws_its_gpu_against_its_jobs_other_gpus(straggling):
    eng, _, charts = straggling
    (alert,) = [a for a in eng.alerts() if a.kind is AlertKind.STRAGGLER and a.state is AlertState.FIRING]
    chart = charts.alerts[alert.id]
    sm, power = chart.series
    assert (sm.reading, power.reading) == ("sm_active_ratio", "power_watts")
    assert sm.peers == 15 and sm.band == "25th-75th percentile"
    # The window's bins: before the straggler the GPU ran with its peers, after it apart from them.
    t = np.array(sm.times)
    before, after = t < T0 + 400, t > T0 + 420
    assert before.any() and after.any() and chart.window_start == sm.times[0]
    subject, median = np.array(sm.subject), np.array(sm.median)
    assert np.nanmax(np.abs(subject[before] - median[before])) < 0.01
    assert np.nanmin(subject[after] - median[after]) > 0.15
    assert np.all(np.array(sm.low)[after] <= median[after]) and np.all(median[after] <= np.array(sm.high)[after])
    assert np.nanmedian(np.array(power.subject)[after]) == pytest.approx(430.0)


def test_a_jobs_last_hour_is_one_point_a_minute(straggling):
    _, _, charts = straggling
    job = charts.jobs["j1"]
    assert job.subject == () and job.reading == "sm_active_ratio"
    # Minutes are the clock's (T0 is 40 s past one): a first partial minute, nine whole ones each at the mean
    # time of its twelve ticks, and the current one, so far a single tick at T0 + 560.
    assert job.times[1:-1] == pytest.approx([T0 + 47.5 + 60 * k for k in range(9)])
    assert job.times[0] < T0 + 20 and job.times[-1] == T0 + 560
    assert job.median[0] == pytest.approx(0.80) and job.median[-2] == pytest.approx(0.62)
    assert all(lo <= m <= hi for lo, m, hi in zip(job.low, job.median, job.high))


def test_the_fleet_view_marks_the_gpu_apart_from_its_job(straggling):
    _, _, charts = straggling
    assert not charts.fleet_per_node and len(charts.fleet) == 16
    by_gpu = {(c.node, c.gpu): c for c in charts.fleet}
    assert by_gpu[("n1", 3)].sm_vs_job_ratio == pytest.approx(0.80 / 0.62, rel=0.01)
    assert by_gpu[("n0", 0)].sm_vs_job_ratio == pytest.approx(1.0)
    assert by_gpu[("n0", 0)].temperature_celsius == pytest.approx(60.0) and by_gpu[("n0", 0)].job == "j1"


def test_reading_the_windows_changes_no_alert():
    lines = cluster_lines(560, override=slow_gpu_from_400)
    _, watched, _ = _drive(lines, 560, ChartHistory())
    _, alone, _ = _drive(lines, 560, None)
    assert [(t.alert.id, t.alert.state, t.alert.evidence) for t in watched] == [
        (t.alert.id, t.alert.state, t.alert.evidence) for t in alone
    ]
    assert any(t.alert.kind is AlertKind.STRAGGLER for t in watched)


def test_past_the_cap_a_fleet_is_drawn_per_node(monkeypatch):
    monkeypatch.setattr(history, "FLEET_GPU_CELLS", 8)
    _, _, charts = _drive(cluster_lines(560, override=slow_gpu_from_400), 560, ChartHistory())
    assert charts.fleet_per_node and [(c.node, c.gpu, c.gpus) for c in charts.fleet] == [
        ("n0", None, 8),
        ("n1", None, 8),
    ]
    # n1's square carries its GPU farthest from the job's median: the straggler.
    assert charts.fleet[1].sm_vs_job_ratio == pytest.approx(0.80 / 0.62, rel=0.01)
    assert charts.fleet[0].sm_vs_job_ratio == pytest.approx(1.0)


def test_a_resolved_alert_keeps_its_one_minute_points():
    lines = cluster_lines(1100, override=lambda t, n, g: slow_gpu_from_400(t, n, g) if t < 700 else {})
    charts_history = ChartHistory()
    _, transitions, charts = _drive(lines, 1100, charts_history)
    resolved = {t.alert.id for t in transitions if t.alert.state is AlertState.RESOLVED}
    assert resolved
    (alert_id,) = resolved
    sm = charts.alerts[alert_id].series[0]
    assert charts.alerts[alert_id].window_start is None
    assert len(sm.times) >= 5 and max(s for s in sm.subject if not math.isnan(s)) > 0.75


def test_jobs_beyond_the_cap_and_the_hour_are_dropped(monkeypatch):
    monkeypatch.setattr(history, "MAX_JOBS", 2)
    lines = []
    for job, start in (("a", 0), ("b", 100), ("c", 200)):
        lines += cluster_lines(60, nodes=1, gpus=2, job=job, t0=T0 + start)
    # A job per node name "n0" would collide; give each its own node.
    lines = [line.replace(b'"node":"n0"', f'"node":"{chr(97 + i // 12)}"'.encode()) for i, line in enumerate(lines)]
    _, _, charts = _drive(lines, 300, ChartHistory())
    assert set(charts.jobs) == {"b", "c"}
    _, _, later = _drive(lines, 300 + 3700, ChartHistory())
    assert later.jobs == {}


def test_downsampled_points_are_minute_means_nan_skipped_and_bounded():
    d = Downsampled(2)
    d.add(0.0, [1.0, math.nan])
    d.add(30.0, [3.0, 4.0])
    d.add(60.0, [5.0, 6.0])
    assert d.snapshot() == [(15.0, 2.0, 4.0), (60.0, 5.0, 6.0)]
    assert d.snapshot(before=60.0) == [(15.0, 2.0, 4.0)]
    for minute in range(2, 200):
        d.add(60.0 * minute, [1.0, 1.0])
    assert len(d.points) == history.POINTS


def test_job_quantiles_match_numpys_and_skip_absent_readings():
    rng = np.random.default_rng(3)
    codes = rng.integers(-1, 4, 400)
    values = rng.uniform(0, 1, 400)
    values[::7] = np.nan
    got = job_quantiles(codes, values)
    for code in range(4):
        group = values[(codes == code) & ~np.isnan(values)]
        assert got[code] == pytest.approx(tuple(np.quantile(group, q) for q in (0.5, 0.25, 0.75)))
    assert -1 not in got and job_quantiles(np.array([0]), np.array([np.nan])) == {}


def test_an_alert_open_longer_than_the_window_keeps_its_minutes_before_it():
    _, _, charts = _drive(cluster_lines(1000, override=slow_gpu_from_400), 1000, ChartHistory())
    ((alert_id, chart),) = charts.alerts.items()
    sm = chart.series[0]
    t = np.array(sm.times)
    older, window = t[t < chart.window_start], t[t >= chart.window_start]
    # One-minute means from when the alert opened (about +415 s) to the window's start (+700 s), then the bins.
    assert chart.window_start == pytest.approx(T0 + 705.0)
    assert 4 <= len(older) <= 6 and older[0] > T0 + 400 and np.all(np.diff(older[1:]) == pytest.approx(60.0))
    assert len(window) == 60 and np.all(np.diff(window) == pytest.approx(5.0))
    subject = np.array(sm.subject)
    assert np.all(subject[: len(older)] == pytest.approx(0.80)) and np.nanmedian(
        subject[len(older) :]
    ) == pytest.approx(0.80)
    assert np.all(np.array(sm.median[: len(older)]) == pytest.approx(0.62))
