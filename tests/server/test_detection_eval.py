"""bench.evaluation.detection_eval's evaluation modes: the unattributed transformation and scoring, the frozen
hold-out and the ablation table's overrides (no full evaluation here: that is the bench's job)."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from gpufleet.server.engine import Engine, EngineConfig, policy
from bench.evaluation import detection_eval, scenarios, tracegen
from bench.evaluation.tracegen import Truth

T0 = 1_763_800_000.0


def _truth(kind, node=None, gpu=None, job="train-1", required=True, start=100.0, end=200.0):
    return Truth(kind, node, gpu, job, T0 + start, T0 + end, required)


def _alert(kind, node=None, gpu=None, job=None, started=110.0):
    return {"kind": kind, "node": node, "gpu": gpu, "hpc_job": job, "started": T0 + started, "resolved": None}


def test_unattributed_evaluation_replays_lines_without_hpc_job_and_leaves_job_kinds_unscored():
    seen: list[bytes] = []

    def replay(lines):
        seen.extend(lines)
        return []

    ev = detection_eval.evaluate(replay, ["comm_slowdown"], seeds=1, unattributed=True)
    gpus = [g for line in seen for g in orjson.loads(line)["gpus"]]
    assert gpus and all("hpc_job" not in g for g in gpus)
    assert ev.unscored == scenarios.JOB_LEVEL_KINDS
    assert not set(scenarios.JOB_LEVEL_KINDS) & set(ev.kinds) and "straggler" in ev.kinds
    # The same scenario attributed does carry the job, and scores its comm_bound truth.
    seen.clear()
    attributed = detection_eval.evaluate(replay, ["comm_slowdown"], seeds=1)
    assert any(g.get("hpc_job") for line in seen for g in orjson.loads(line)["gpus"])
    assert attributed.kinds["comm_bound"].required == 1 and attributed.unscored == ()


def test_unattributed_scoring_drops_job_kinds_and_matches_gpu_and_node_subjects_without_the_job():
    truths = [
        _truth("comm_bound"),  # job subject: no job to name without attribution
        _truth("input_bound"),
        _truth("straggler", "n1", 3),  # GPU subject, of job train-1
        _truth("straggler", "n2", None),  # node subject
        _truth("thermal_throttle", "n0", 0, job=None),
    ]
    alerts = [
        _alert("comm_bound", job="inferred-0"),
        _alert("straggler", "n1", 3),
        _alert("straggler", "n2", None),
        _alert("thermal_throttle", "n0", 0),
        _alert("gpu_lost", "n3", 1),  # nothing explains it
    ]
    kept_alerts, kept_truths = scenarios.unattributed(alerts, truths)
    assert {a["kind"] for a in kept_alerts} == {"straggler", "thermal_throttle", "gpu_lost"}
    assert [(t.kind, t.node, t.gpu, t.hpc_job) for t in kept_truths] == [
        ("straggler", "n1", 3, None),
        ("straggler", "n2", None, None),
        ("thermal_throttle", "n0", 0, None),
    ]
    result = scenarios.score(kept_alerts, kept_truths)
    assert result.kinds["straggler"].tp == 2 and result.kinds["straggler"].recall == 1.0
    assert result.kinds["thermal_throttle"].tp == 1
    assert result.kinds["gpu_lost"].fp == 1 and result.kinds["comm_bound"].required == 0
    # A straggler alert on another GPU of the node does not match the GPU truth.
    wrong = scenarios.score(*scenarios.unattributed([_alert("straggler", "n1", 2)], truths))
    assert wrong.kinds["straggler"].fp == 1 and wrong.kinds["straggler"].detected == 0


def test_holdout_is_frozen_at_the_generator_version_and_out_of_reach_of_tuning_runs(capsys):
    assert detection_eval.HOLDOUT_GENERATOR_VERSION == tracegen.GENERATOR_VERSION
    assert detection_eval.HOLDOUT_FIRST_SEED >= 1000 and detection_eval.HOLDOUT_SEEDS >= 100
    # Tuning runs (--first-seed) cannot reach the hold-out, and --holdout takes no other seeds.
    for argv in (
        ["--first-seed", str(detection_eval.HOLDOUT_FIRST_SEED)],
        ["--first-seed", str(detection_eval.HOLDOUT_FIRST_SEED - 2), "--seeds", "3"],
        ["--holdout", "--first-seed", "5"],
        ["--holdout", "--seeds", str(detection_eval.HOLDOUT_SEEDS + 1)],
    ):
        with pytest.raises(SystemExit) as exc:
            detection_eval.main(argv)
        assert exc.value.code == 2
    assert "hold-out" in capsys.readouterr().err


def test_holdout_scores_its_own_seed_range(monkeypatch):
    built: list[int] = []
    real = scenarios.BY_NAME["slow_node"]
    monkeypatch.setitem(scenarios.BY_NAME, "slow_node", replace(real, build=lambda s: built.append(s) or real.build(s)))
    ev = detection_eval.evaluate(lambda lines: [], ["slow_node"], seeds=2, first_seed=detection_eval.HOLDOUT_FIRST_SEED)
    assert built == [detection_eval.HOLDOUT_FIRST_SEED, detection_eval.HOLDOUT_FIRST_SEED + 1]
    assert ev.first_seed == detection_eval.HOLDOUT_FIRST_SEED


def test_the_ablations_are_every_declared_rule_each_switched_off_alone():
    ablations = detection_eval.declared_ablations()
    declared = [(detector, rule.name) for detector, rules in policy.declared_rules().items() for rule in rules]
    assert [(ab.detector, ab.name) for ab in ablations] == declared and declared
    for ab in ablations:
        config = EngineConfig.from_mapping(dict(ab.overrides))
        assert config.disabled_rules == {ab.name}
        Engine(config)  # the engine knows the name


def test_ablation_table_lists_the_kinds_each_rule_moves_and_an_override_the_engine_refuses():
    def replay(lines, config=None):
        if config and "bogus_setting" in config:
            raise ValueError("unknown engine config key 'bogus_setting'")
        return []

    table = detection_eval.ablate(
        replay,
        ["slow_node"],
        seeds=1,
        ablations=(
            detection_eval.Ablation("gone", "a rule the engine no longer has", {"bogus_setting": 1.0}),
            detection_eval.Ablation("silent", "every rule", {"straggler_for_seconds": 1e9}, "straggler"),
        ),
    )
    baseline = {"straggler": scenarios.KindScore(tp=1, required=1, detected=1)}
    rows = "\n".join(detection_eval.render_ablations(table, baseline))
    assert "not run: unknown engine config key 'bogus_setting'" in rows
    # Replaying nothing misses the slow node the baseline found: recall falls by one.
    assert "| straggler | `silent` | every rule | `straggler` | – | – | 0.000 | -1.000 |" in rows


def test_report_section_is_written_between_its_markers_only(tmp_path):
    doc = tmp_path / "evaluation.md"
    doc.write_text("# Evaluation\n\nintro\n")
    detection_eval.REPORT.write(doc, "v1")
    detection_eval.REPORT.write(doc, "v2")
    text = doc.read_text()
    assert text.startswith("# Evaluation\n\nintro\n") and "v2" in text and "v1" not in text
    assert text.count(detection_eval.REPORT.begin) == 1


def test_report_says_which_kinds_were_not_scored_which_seeds_ran_and_where_it_failed():
    def ev(first_seed=0, unscored=()):
        kinds = {k: scenarios.KindScore() for k in scenarios.ALERT_KINDS if k not in unscored}
        kinds["straggler"] = scenarios.KindScore(tp=3, fp=1, required=4, detected=3, ttf_s=[40.0, 50.0, 60.0])
        row = detection_eval.ScenarioResult("slow_node", runs=2, required=4, detected=3, fp=1)
        return detection_eval.Evaluation(2, kinds, dict(kinds), [row], 0, 0.0, first_seed, unscored)

    rep = detection_eval.Report(
        ["slow_node"],
        [
            ("Defaults", "as generated", ev()),
            ("Unattributed", "no hpc_job", ev(unscored=scenarios.JOB_LEVEL_KINDS)),
            ("Hold-out", "frozen", ev(first_seed=detection_eval.HOLDOUT_FIRST_SEED)),
        ],
        1,
        [],
        {},
        60.0,
    )
    text = detection_eval.render_report(rep)
    assert "1 of the" in text and "a subset" in text and "--seeds 2" in text
    first = detection_eval.HOLDOUT_FIRST_SEED
    assert f"| Hold-out | frozen | {first:,} – {first + 1:,} |" in text
    assert text.count("Not scored: `comm_bound`, `input_bound`") == 1
    assert "| `straggler` | 0.750 | 0.750 | 3 | 1 | 4 | 3 | 50 | 50 |" in text
    assert "slow_node (1 missed, 1 false)" in text
