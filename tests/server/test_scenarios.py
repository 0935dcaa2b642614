"""Every catalog scenario through replay: required alerts fire on the right subject in time, nothing else.

The traces come from bench/evaluation/tracegen.py (physics, not the engine's rules); the ground truth and
the matching rules are in bench/evaluation/scenarios.py. Bigger, busier scenarios run in
bench/evaluation/detection_eval.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from bench.evaluation import scenarios
from bench.evaluation.tracegen import generate, without_fields

SEEDS = (0, 1)
SMALL = [s.name for s in scenarios.CATALOG if s.small]


@pytest.fixture(scope="module")
def run_replay():
    """gpufleet.server.replay.run_replay, or a skip while the engine does not exist yet."""
    try:
        from gpufleet.server.replay import run_replay as fn
    except ModuleNotFoundError as exc:
        if exc.name in ("gpufleet.server.replay", "gpufleet.server.engine"):
            pytest.skip("engine not written yet (server.replay is missing)")
        raise
    return fn


def _problems(trace, alerts) -> list[str]:
    """Human-readable reasons a run fails: missed or late required truths and unexplained alerts."""
    result = scenarios.score(alerts, trace.truths, trace_end=trace.spec.t0 + trace.spec.duration_s)
    t0 = trace.spec.t0
    out = [f"missed {scenarios.describe_truth(t, t0)}" for t in result.missed]
    out += [f"late by {ttf:.0f}s: {scenarios.describe_truth(t, t0)}" for t, ttf in result.late]
    out += [f"false alert {scenarios.describe_alert(a, t0)}" for a in result.false_alerts]
    out += [
        f"stuck alert {scenarios.describe_alert(a, t0)} after {scenarios.describe_truth(t, t0)}"
        for a, t in result.stuck
    ]
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", SMALL)
def test_scenario_through_replay(run_replay, name, seed):
    spec = scenarios.BY_NAME[name].build(seed)
    trace = generate(spec)
    alerts = run_replay(trace.lines)
    problems = _problems(trace, alerts)
    context = f"{name} seed={seed} interval={spec.interval_s}s order={spec.order}"
    assert not problems, context + "\n  " + "\n  ".join(problems)


def test_busy_cluster_through_replay(run_replay):
    trace = generate(scenarios.BY_NAME["busy_8"].build(0))
    problems = _problems(trace, run_replay(trace.lines))
    assert not problems, "busy_8 seed=0\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("seed", SEEDS)
def test_straggler_from_the_start_resolves_when_the_gpu_recovers(run_replay, seed):
    # Its open alert keeps the job from ever learning a baseline; it must still clear, or it would
    # hide every later comm_bound of the job.
    trace = generate(scenarios.BY_NAME["early_straggler_then_comm"].build(seed))
    recovered = next(t.end for t in trace.truths if t.kind == "straggler")
    stragglers = [a for a in run_replay(trace.lines) if a.kind.value == "straggler"]
    assert len(stragglers) == 1
    assert stragglers[0].resolved is not None and stragglers[0].resolved - recovered < 180.0


def test_a_lost_gpu_names_the_job_it_leaves_hanging(run_replay):
    # The agent reports no job for a dead GPU from the very sample that says up=false; the alert still
    # names the job, and that job's hang (utilization high, SM activity gone) is not comm_bound.
    trace = generate(scenarios.BY_NAME["gpu_lost_hang"].build(0))
    job = trace.spec.jobs[0].hpc_job
    alerts = run_replay(trace.lines)
    assert {(a.kind.value, a.hpc_job) for a in alerts} == {("gpu_lost", job), ("xid", job)}


def test_a_job_is_taken_as_hung_only_for_lost_gpu_hang_seconds(run_replay):
    # A job still running that long after losing a GPU has gone on without it (an elastic restart under
    # the same job id) and is judged again: with a 60 s window, the 7-minute hang of seed 0 reads as
    # comm_bound from about 60 s + comm_for_seconds after the loss.
    from gpufleet.server.engine import EngineConfig

    trace = generate(scenarios.BY_NAME["gpu_lost_hang"].build(0))
    lost_at = trace.spec.t0 + next(i.start_s for i in trace.spec.incidents if i.kind == "gpu_lost")
    short = run_replay(trace.lines, EngineConfig.from_mapping({"lost_gpu_hang_seconds": 60}))
    comm = [a for a in short if a.kind.value == "comm_bound"]
    assert len(comm) == 1 and comm[0].started >= lost_at + 60 + 30
    assert not [a for a in run_replay(trace.lines) if a.kind.value == "comm_bound"]


def test_no_straggler_among_the_gpus_a_lost_gpu_left_hanging(run_replay):
    # Seed 5 without SM activity: in the hang one GPU drew 10 % more power than the others, and was
    # named a straggler of a job whose real culprit had fallen off the bus.
    trace = generate(scenarios.BY_NAME["gpu_lost_hang"].build(5))
    alerts = run_replay(without_fields(trace.lines, ("sm_active_ratio",)))
    assert sorted(a.kind.value for a in alerts) == ["gpu_lost", "xid"]


def test_without_attribution_a_lost_gpu_leaves_every_group_of_its_model_hanging(run_replay):
    # Seed 8 without hpc_job: the job spans two nodes, which the engine cannot know. In the hang a GPU on
    # the other node drew more power than its node's others and was named a straggler.
    trace = generate(scenarios.BY_NAME["gpu_lost_hang"].build(8))
    assert len(trace.spec.nodes) == 2
    alerts = run_replay(without_fields(trace.lines, ("hpc_job",)))
    assert sorted((a.kind.value, a.hpc_job) for a in alerts) == [("gpu_lost", None), ("xid", None)]


def test_two_jitters_of_one_gpu_with_a_gap_between_name_nobody(run_replay):
    # Unseen busy_16 seed 182 (2 s sampling): GPU 5 of hgx-006 slow for 13 s, then for 15 s, 11 s later.
    # The pending grace bridged the gap, and counted as held it made up the for duration: the GPU was
    # named as the second spell ended, and stayed named for 80 s.
    spec = scenarios.BY_NAME["busy_16"].build(182)
    assert spec.interval_s == 2.0
    jitters = sorted(i.start_s for i in spec.incidents if i.kind == "jitter" and (i.node, i.gpu) == ("hgx-006", 5))
    assert len(jitters) == 2
    trace = generate(spec)
    problems = _problems(trace, run_replay(trace.lines))
    assert not problems, "busy_16 seed=182\n  " + "\n  ".join(problems)


def test_a_node_slow_from_the_start_is_named_not_its_highest_gpu(run_replay):
    # Unseen node_from_start seed 183: two A100 nodes (no SM activity), dgx-002 slow from the start.
    # Every GPU of it drew 9-15 % more power than the job's median, which lies between the two nodes;
    # the three highest crossed the margin and one of them was named on its own before the node was.
    spec = scenarios.BY_NAME["node_from_start"].build(183)
    assert len(spec.nodes) == 2 and spec.nodes[0].model.name.startswith("NVIDIA A100")
    trace = generate(spec)
    stragglers = [a for a in run_replay(trace.lines) if a.kind.value == "straggler"]
    assert [(a.node, a.gpu) for a in stragglers] == [("dgx-002", None)]
    assert stragglers[0].evidence["pattern"] == "node_slow"


@pytest.mark.parametrize("name,seed", [("node_brake", 2), ("node_power_cap", 15)])
def test_a_slowed_node_is_named_not_the_node_spinning_at_full_clocks(run_replay, name, seed):
    # Two A100 nodes (no SM activity): the braked or capped node draws less power than the node waiting
    # for it, which read as "the other node stays busy" until clocks and bits counted at node level.
    spec = scenarios.BY_NAME[name].build(seed)
    assert len(spec.nodes) == 2 and spec.nodes[0].model.name.startswith("NVIDIA A100")
    trace = generate(spec)
    stragglers = [a for a in run_replay(trace.lines) if a.kind.value == "straggler"]
    assert [(a.node, a.gpu) for a in stragglers] == [(spec.incidents[0].node, None)]
    assert stragglers[0].evidence["pattern"] == "node_clocks_cut"
    cause = {"node_brake": "hw_slowdown_or_power_brake", "node_power_cap": "sw_power_cap"}[name]
    assert stragglers[0].evidence["throttle_causes"] == [cause], stragglers[0].summary


def test_row_remap_xid_allows_the_pending_remap_ecc_alert(run_replay):
    # Seed 6 draws XID 64: the generator leaves a row remap pending, and the ecc alert saying so is right.
    spec = scenarios.BY_NAME["xid_burst"].build(6)
    assert spec.incidents[0].code in (63, 64)
    trace = generate(spec)
    alerts = run_replay(trace.lines)
    assert any(a.kind.value == "ecc" and "row remapping pending" in a.summary for a in alerts)
    problems = _problems(trace, alerts)
    assert not problems, "xid_burst seed=6\n  " + "\n  ".join(problems)


def test_replay_cli_prints_one_json_alert_per_line(run_replay, tmp_path):
    trace = generate(scenarios.BY_NAME["cooling_failure"].build(0))
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in trace.lines) + b"{not json\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gpufleet.server.cli", "replay", str(path)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    alerts = [orjson.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    for a in alerts:
        assert {
            "kind",
            "severity",
            "node",
            "gpu",
            "uuid",
            "hpc_job",
            "started",
            "resolved",
            "summary",
            "evidence",
        } <= set(a)
    assert str(len(trace.lines) + 1).encode() in proc.stderr  # the malformed line, by number
    key = lambda a: (a["kind"], a["node"], a["gpu"], a["hpc_job"], a["started"])  # noqa: E731
    in_process = [scenarios.normalize(a) for a in run_replay(trace.lines)]
    assert sorted(map(key, alerts)) == sorted(map(key, in_process)) and alerts


# ------------------------------------------------------------------ the scoring rules (no engine needed)


def _truth(kind="straggler", node="n0", gpu=3, job="7", start=1000.0, end=1400.0, required=True, lead=0.0):
    from bench.evaluation.tracegen import Truth

    return Truth(kind, node, gpu, job, start, end, required, "", lead)


def _alert(kind="straggler", node="n0", gpu=3, job="7", started=1040.0):
    return {"kind": kind, "node": node, "gpu": gpu, "hpc_job": job, "started": started}


def test_score_counts_a_matching_alert_as_detected_with_its_time_to_fire():
    result = scenarios.score([_alert(started=1040.0)], [_truth()])
    ks = result.kinds["straggler"]
    assert (ks.tp, ks.fp, ks.required, ks.detected, ks.ttf_s) == (1, 0, 1, 1, [40.0])
    assert ks.precision == 1.0 and ks.recall == 1.0 and not result.missed and not result.late


def test_score_wrong_subject_is_a_false_alert_and_a_miss():
    result = scenarios.score([_alert(gpu=4), _alert(node="n1")], [_truth()])
    ks = result.kinds["straggler"]
    assert (ks.tp, ks.fp, ks.detected) == (0, 2, 0) and len(result.missed) == 1
    node_truth = _truth(gpu=None)
    assert scenarios.score([_alert(gpu=3)], [node_truth]).kinds["straggler"].fp == 1
    assert scenarios.score([_alert(gpu=None)], [node_truth]).kinds["straggler"].tp == 1


def test_score_window_grace_lead_and_deadline():
    truth = _truth(lead=30.0)
    assert scenarios.score([_alert(started=975.0)], [truth]).kinds["straggler"].ttf_s == [5.0]
    assert scenarios.score([_alert(started=960.0)], [truth]).kinds["straggler"].fp == 1
    # A node clock running behind stamps an instant alert up to CLOCK_SLACK_S before the true start.
    lost = _truth("gpu_lost", start=1000.0)
    assert (
        scenarios.score([_alert("gpu_lost", started=1000.0 - scenarios.CLOCK_SLACK_S)], [lost]).kinds["gpu_lost"].tp
        == 1
    )
    assert (
        scenarios.score([_alert("gpu_lost", started=999.0 - scenarios.CLOCK_SLACK_S)], [lost]).kinds["gpu_lost"].fp == 1
    )
    assert scenarios.score([_alert(started=1400.0 + scenarios.GRACE_S)], [truth]).kinds["straggler"].tp == 1
    assert scenarios.score([_alert(started=1401.0 + scenarios.GRACE_S)], [truth]).kinds["straggler"].fp == 1
    late = scenarios.score([_alert(started=970.0 + scenarios.DEADLINE_S + 1)], [truth]).late
    assert len(late) == 1


def test_score_an_alert_held_through_a_brief_recovery_detects_the_next_episode():
    first, second = _truth(start=1000.0, end=1100.0), _truth(start=1130.0, end=1300.0)
    held = {**_alert(started=1040.0), "resolved": None}
    result = scenarios.score([held], [first, second])
    assert result.kinds["straggler"].detected == 2 and result.kinds["straggler"].tp == 1
    ended = {**_alert(started=1040.0), "resolved": 1110.0}
    assert scenarios.score([ended], [first, second]).kinds["straggler"].detected == 1


def test_score_an_alert_outliving_its_incident_is_stuck():
    truth = _truth(start=1000.0, end=1400.0)
    due = 1400.0 + scenarios.RESOLVE_S
    open_alert = {**_alert(), "resolved": None}
    assert scenarios.score([open_alert], [truth]).stuck == []  # no trace end: not judged
    assert scenarios.score([open_alert], [truth], trace_end=due - 1).stuck == []
    assert len(scenarios.score([open_alert], [truth], trace_end=due + 1).stuck) == 1
    assert scenarios.score([{**_alert(), "resolved": due}], [truth], trace_end=9e9).stuck == []
    assert len(scenarios.score([{**_alert(), "resolved": due + 1}], [truth], trace_end=9e9).stuck) == 1
    # A later episode on the same subject that the open alert runs into keeps it legitimately open.
    later = _truth(start=1500.0, end=2000.0)
    assert scenarios.score([open_alert], [truth, later], trace_end=2000.0 + scenarios.RESOLVE_S - 1).stuck == []
    # Health alerts clear on their own timers and are not judged.
    unreachable = {**_alert(kind="node_unreachable", gpu=None), "resolved": None}
    assert scenarios.score([unreachable], [_truth(kind="node_unreachable", gpu=None)], trace_end=9e9).stuck == []


def test_score_allowed_truths_are_neutral_and_job_alerts_match_on_hpc_job():
    allowed = _truth(required=False)
    result = scenarios.score([_alert()], [allowed])
    assert (result.kinds["straggler"].neutral, result.kinds["straggler"].fp) == (1, 0)
    assert result.kinds["straggler"].precision is None and result.kinds["straggler"].recall is None
    job = _truth("comm_bound", None, None, "7")
    assert scenarios.score([_alert("comm_bound", None, None, "7")], [job]).kinds["comm_bound"].tp == 1
    assert scenarios.score([_alert("comm_bound", None, None, "8")], [job]).kinds["comm_bound"].fp == 1
    assert scenarios.score([_alert("comm_bound", "n0", None, "7")], [job]).kinds["comm_bound"].fp == 1


def test_score_accepts_alert_objects():
    from gpufleet.server.alerts import Alert, AlertKind, AlertState, Severity

    alert = Alert(
        "x",
        "f",
        AlertKind.STRAGGLER,
        Severity.WARNING,
        AlertState.FIRING,
        "n0",
        3,
        None,
        "7",
        1030.0,
        1040.0,
        None,
        1040.0,
        "s",
    )
    assert scenarios.score([alert], [_truth()]).kinds["straggler"].tp == 1


def test_detection_doc_section_replaces_only_between_markers(tmp_path):
    from bench.evaluation.detection_eval import SUITE

    doc = tmp_path / "detection.md"
    SUITE.write(doc, "first", "Evaluation")
    assert SUITE.heading in doc.read_text() and "first" in doc.read_text()
    head, begin, end = SUITE.heading, SUITE.begin, SUITE.end
    doc.write_text(f"# Detection\n\nengine text\n\n{head}\n\n{begin}\nold\n{end}\n\nmore engine text\n")
    SUITE.write(doc, "new body")
    expected = f"# Detection\n\nengine text\n\n{head}\n\n{begin}\nnew body\n{end}\n\nmore engine text\n"
    assert doc.read_text() == expected


def test_mid_job_skips_the_start_up_of_jobs_starting_with_the_trace_and_moves_incidents_earlier_together():
    from bench.evaluation.tracegen import ClusterSpec, Incident, Job, NodeSpec

    spec = ClusterSpec(
        (NodeSpec("n0"),),
        (Job("a", "1", (("n0", (0, 1, 2, 3)),)), Job("b", "2", (("n0", (4, 5, 6, 7)),), start_s=100.0)),
        (
            Incident("slow_gpu", 300.0, 500.0, "n0", 1),
            Incident("jitter", 350.0, 360.0, "n0", 2),
            Incident("gpu_lost", 400.0, 1e9, "n0", 3),
            Incident("counter_reset", 450.0, 0.0, "n0"),
        ),
    )
    out = scenarios.mid_job(spec, 60.0)
    assert [(j.startup_s, j.start_s) for j in out.jobs] == [(0.0, 0.0), (spec.jobs[1].startup_s, 100.0)]
    assert [(i.start_s, i.end_s) for i in out.incidents] == [(60.0, 260.0), (110.0, 120.0), (160.0, 1e9), (210.0, 0.0)]
    # Incidents already earlier than the onset stay where they are.
    assert scenarios.mid_job(spec, 400.0).incidents == spec.incidents


def test_mid_job_leaves_the_incidents_of_a_job_starting_later_where_they_were():
    from bench.evaluation.tracegen import ClusterSpec, Incident, Job, NodeSpec

    spec = ClusterSpec(
        (NodeSpec("n0"), NodeSpec("n1")),
        (Job("a", "1", (("n0", (0, 1, 2, 3)),)), Job("b", "2", (("n1", (0, 1, 2, 3)),), start_s=200.0)),
        (
            Incident("comm_slowdown", 500.0, 900.0, job="b"),
            Incident("slow_gpu", 520.0, 800.0, "n1", 2),
            Incident("cooling_failure", 400.0, 700.0, "n1"),
            Incident("slow_gpu", 300.0, 600.0, "n0", 1),
            Incident("jitter", 350.0, 360.0, "n1", 5),
        ),
    )
    out = scenarios.mid_job(spec, 60.0)
    # Job b's slowdown, a GPU of b and a node b runs on keep their times; job a's straggler and a GPU
    # no job uses move by the same 240 s.
    assert [(i.start_s, i.end_s) for i in out.incidents] == [
        (500.0, 900.0),
        (520.0, 800.0),
        (400.0, 700.0),
        (60.0, 360.0),
        (110.0, 120.0),
    ]


@pytest.mark.parametrize(
    "scenario, probe, bad",
    [
        ("decoy_jitter", ["--noise-scale", "2"], ["--noise-scale", "-1"]),
        ("comm_slowdown", ["--mid-job", "120"], ["--mid-job", "-5"]),
    ],
)
def test_detection_eval_probes_score_and_never_write_into_the_document(tmp_path, capsys, scenario, probe, bad):
    from bench.evaluation.detection_eval import main

    doc = tmp_path / "detection.md"
    doc.write_text("untouched\n")
    assert main(["--seeds", "1", "--scenarios", scenario, *probe, "--doc", str(doc)]) == 0
    assert doc.read_text() == "untouched\n" and scenario in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(bad)


def test_benchmarks_doc_section_replaces_only_its_own_figures(tmp_path):
    from bench.replay_bench import SECTION

    BEGIN, END, HEADING = SECTION.begin, SECTION.end, SECTION.heading

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Agent\n\nagent figures\n")
    SECTION.write(doc, "v1\n")
    SECTION.write(doc, "v2\n")
    text = doc.read_text()
    assert "agent figures" in text and "v2" in text and "v1" not in text and text.count(HEADING) == 1
    # A section from before the markers is replaced whole, up to the next heading.
    doc.write_text(f"# Benchmarks\n\n{HEADING}\n\nold\n\n## Agent\n\nagent figures\n")
    SECTION.write(doc, "v3")
    assert doc.read_text() == f"# Benchmarks\n\n{HEADING}\n\n{BEGIN}\nv3\n{END}\n\n## Agent\n\nagent figures\n"
    # Notes written after the figures, in the same section, survive a new run.
    doc.write_text(f"# Benchmarks\n\n{HEADING}\n\n{BEGIN}\nv3\n{END}\n\nnotes\n\n## Agent\n\nagent figures\n")
    SECTION.write(doc, "v4")
    assert doc.read_text() == f"# Benchmarks\n\n{HEADING}\n\n{BEGIN}\nv4\n{END}\n\nnotes\n\n## Agent\n\nagent figures\n"


@pytest.mark.parametrize("name", ["power_brake", "decoy_power_cap"])
def test_without_clock_readings_throttle_bits_name_the_culprit_and_the_cap(run_replay, name):
    # No SM clocks: the power-brake bit alone marks the culprit, and the power-cap bit on most of a job's
    # GPUs marks a power drop as the operator's cap rather than the job waiting in collectives.
    trace = generate(scenarios.BY_NAME[name].build(0))
    alerts = run_replay(without_fields(trace.lines, ("sm_clock_hertz", "sm_clock_max_hertz")))
    problems = _problems(trace, alerts)
    assert not problems, f"{name} seed=0 without clocks\n  " + "\n  ".join(problems)


def test_a_gpu_standing_out_for_a_tick_now_and_then_does_not_hold_back_input_bound(run_replay):
    # busy_32 seed 29 at 10 s sampling: job j1 (5 A100 nodes) is starved of input from +445 s. At the
    # weaker margins one of its GPUs or another stood out for a single tick about once a minute, and each
    # time that cleared the pending input_bound: it fired 171 s after the onset. Only an explanation (a
    # straggler, throttling, a lost GPU) clears it now; a tick's flicker falls within the pending grace.
    spec = scenarios.BY_NAME["busy_32"].build(29)
    assert spec.interval_s == 10.0
    trace = generate(spec)
    truth = next(t for t in trace.truths if t.kind == "input_bound")
    (alert,) = [a for a in run_replay(trace.lines) if a.kind.value == "input_bound"]
    assert alert.hpc_job == truth.hpc_job and alert.started - truth.start < 90.0


@pytest.mark.parametrize(
    "name,seed,interval_s", [("decoy_jitter", 48, 1.0), ("decoy_jitter", 51, 10.0), ("busy_32", 74, 5.0)]
)
def test_jitters_back_to_back_name_nobody_once_the_gpu_recovered(run_replay, name, seed, interval_s):
    # Seeds never tuned on. decoy_jitter 48: three GPUs of one node slow in turn for 10-15 s each, the
    # job waiting 32 s in all; 51: one GPU slow twice, 14 s and 10 s, 4 s apart; busy_32 74: one GPU
    # slow twice, 12 s and 13 s, 12 s apart. A GPU that recovered reads its normal level at once, while
    # its peers' 30 s medians hold their wait for 15-30 s more: on those medians alone it stood out long
    # enough to be named a straggler.
    spec = scenarios.BY_NAME[name].build(seed)
    assert spec.interval_s == interval_s
    trace = generate(spec)
    problems = _problems(trace, run_replay(trace.lines))
    assert not problems, f"{name} seed={seed}\n  " + "\n  ".join(problems)
