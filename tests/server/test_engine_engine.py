"""The Engine facade: determinism across ingest order and chunking, views, stats, restore."""

from __future__ import annotations

import random

from gpufleet.server.alerts import AlertKind, AlertState
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig
from tests.server.engine_samples import T0, cluster_lines


def _incident(t, node, gpu):
    kw = {}
    if (node, gpu) == ("n1", 3) and t >= 400:
        kw.update(temperature_celsius=86.0, throttle_reasons=0x40, sm_clock_hertz=1.4e9, sm_active_ratio=0.8)
    elif t >= 400:
        kw.update(sm_active_ratio=0.6, power_watts=420.0)
    return kw


def _drive(samples, step=5.0, end=None, phase=0.0):
    eng = Engine()
    transitions = []
    end = end or max(s.time for s in samples) + step
    t = T0 + phase
    pending = sorted(samples, key=lambda s: s.time)
    i = 0
    while t <= end:
        batch = []
        while i < len(pending) and pending[i].time < t:
            batch.append(pending[i])
            i += 1
        random.Random(int(t)).shuffle(batch)
        for s in batch:
            eng.ingest(s)
        transitions += eng.advance(t)
        t += step
    return eng, [
        (tr.alert.id, tr.alert.state, tr.alert.started, tr.alert.resolved, tr.alert.severity) for tr in transitions
    ]


def _fired(transitions: list) -> list:
    """The transitions past pending, comparable across replicas."""
    return sorted((i, s.value, st, r, sev.value) for i, s, st, r, sev in transitions if s is not AlertState.PENDING)


def test_same_samples_same_alerts_whatever_the_ingest_chunking():
    samples = [parse_line(line) for line in cluster_lines(700, override=_incident)]
    _, a = _drive(samples, step=5.0)
    _, b = _drive(samples, step=15.0)
    assert _fired(a) == _fired(b) and _fired(a)


def test_two_replicas_pulling_at_other_moments_raise_the_same_alerts_under_the_same_ids():
    # An HA pair: each server pulls on its own schedule. Alertmanager merges their alerts only if the
    # labels (kind, severity, node, gpu, job) agree, and the dashboard's table only if the ids do.
    samples = [parse_line(line) for line in cluster_lines(700, override=_incident)]
    _, a = _drive(samples, step=5.0)
    _, b = _drive(samples, step=5.0, phase=2.5)
    _, c = _drive(samples, step=1.0, phase=0.4)
    assert _fired(a) == _fired(b) == _fired(c) and _fired(a)


def test_views_report_jobs_nodes_and_stats():
    samples = [parse_line(line) for line in cluster_lines(700, override=_incident)]
    eng, _ = _drive(samples)
    (job,) = eng.jobs()
    assert job.hpc_job == "j1" and job.gpus == 16 and job.nodes == ("n0", "n1")
    assert {"node": "n1", "gpu": 3} in job.stragglers and job.to_dict()["stragglers"]
    nodes = {n.node: n for n in eng.nodes()}
    assert nodes["n1"].reachable and nodes["n1"].gpus == 8 and nodes["n1"].open_alerts >= 2
    st = eng.stats()
    assert st.samples_ingested == len(samples) * 8 and st.gpus == 16 and st.firing_alerts >= 2
    assert st.to_dict()["ticks"] == st.ticks


def _hot(*culprits):
    """_incident with any number of hot, clock-cut GPUs holding the job back."""

    def override(t, node, gpu):
        kw = {}
        if (node, gpu) in culprits and t >= 400:
            kw.update(temperature_celsius=86.0, throttle_reasons=0x40, sm_clock_hertz=1.4e9, sm_active_ratio=0.8)
        elif t >= 400:
            kw.update(sm_active_ratio=0.6, power_watts=420.0)
        return kw

    return override


def _losses(override):
    """(first straggler firing time, the job's gpu_hours_lost after each 5 s tick, its last JobHealth)."""
    samples = sorted((parse_line(line) for line in cluster_lines(700, override=override)), key=lambda s: s.time)
    eng, i, t, fired, lost = Engine(), 0, T0, None, []
    while t <= samples[-1].time + 5:
        while i < len(samples) and samples[i].time < t:
            eng.ingest(samples[i])
            i += 1
        for tr in eng.advance(t):
            if tr.alert.kind == AlertKind.STRAGGLER and tr.alert.state is AlertState.FIRING and fired is None:
                fired = tr.alert.started
        jobs = eng.jobs()
        lost.append((t, jobs[0].gpu_hours_lost if jobs else 0.0))
        t += 5.0
    return fired, lost, eng.jobs()[0]


def test_a_job_counts_the_gpu_hours_lost_while_its_straggler_fires_and_once_for_two_culprits():
    fired, lost, job = _losses(_hot(("n1", 3)))
    assert fired is not None
    # Pending counts nothing; from the firing tick on the job loses at most all its 16 GPUs' time.
    assert all(hours == 0.0 for t, hours in lost if t < fired) and lost[-1][1] > 0
    assert lost[-1][1] <= 16 * (lost[-1][0] - fired + 5.0) / 3600.0
    assert [h for _, h in lost] == sorted(h for _, h in lost)
    assert job.to_dict()["gpu_hours_lost_by_kind"] == {"straggler": job.gpu_hours_lost}
    # Two culprits each estimate the same job-wide loss: the job does not lose it twice.
    fired_two, lost_two, job_two = _losses(_hot(("n1", 3), ("n0", 5)))
    assert fired_two == fired and job_two.gpu_hours_lost == job.gpu_hours_lost
    assert len(job_two.stragglers) == 2


def test_restore_after_restart_keeps_ids_of_open_alerts():
    samples = [parse_line(line) for line in cluster_lines(700, override=_incident)]
    eng, _ = _drive(samples)
    before = {a.fingerprint: a.id for a in eng.alerts() if a.state is AlertState.FIRING}
    fresh = Engine(EngineConfig())
    assert fresh.restore(eng.alerts()) == len(eng.alerts())
    late = [s for s in samples if s.time >= T0 + 600]
    for s in late:
        fresh.ingest(s)
    fresh.advance(T0 + 700)
    after = {a.fingerprint: a.id for a in fresh.alerts() if a.state is AlertState.FIRING}
    assert before.items() <= after.items()


def test_advance_without_samples_is_harmless():
    eng = Engine()
    assert eng.advance(T0) == [] and eng.alerts() == [] and eng.jobs() == []


def test_a_day_long_silence_is_skipped_not_evaluated_tick_by_tick():
    eng = Engine()
    for line in cluster_lines(120) + cluster_lines(120, t0=T0 + 86_400):
        s = parse_line(line)
        eng.ingest(s)
        eng.advance(s.time)
    eng.advance(T0 + 86_400 + 125)
    assert eng.stats().ticks < 200
    assert eng.stats().last_tick_time == T0 + 86_400 + 125


def test_an_unattributed_node_whose_busy_set_changes_forgets_its_baseline_and_offsets():
    # GPUs 4-7 of n0 start another (unattributed) job at 400 s: the node group's history and its
    # GPUs' learned offsets described the old work, so they are dropped.
    def second_job(t, node, gpu):
        if gpu >= 4 and not (node == "n0" and t >= 400):
            return {"utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}
        return {}

    samples = [parse_line(x) for x in cluster_lines(700, override=second_job, job=None)]
    eng, _ = _drive([s for s in samples if s.time < T0 + 400])
    n0 = eng.registry.ids[("node_model", eng.windows.node_ids["n0"], 0)]
    slots = [eng.windows.slot_of[("n0", g)] for g in range(4)]
    assert eng.history.baseline("sm")[n0] > 0 and (eng.state("straggler").learned[slots] > 20).all()
    for s in samples:
        if T0 + 400 <= s.time < T0 + 440:
            eng.ingest(s)
    eng.advance(T0 + 445)
    assert eng.registry.first_seen[n0] > T0 + 400
    assert eng.history.baseline("sm")[n0] != eng.history.baseline("sm")[n0]  # NaN: no baseline yet
    assert (eng.state("straggler").learned[slots] <= 9).all()  # at most the ticks since 400 s
