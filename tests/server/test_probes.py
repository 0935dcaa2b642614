"""bench.evaluation.probes: probe scenarios stay out of the catalog, build the fleets they describe, and are scored by
bench.evaluation.detection_eval --probes (one small probe replayed for real; the large ones are the bench's job)."""

from __future__ import annotations

import orjson
import pytest

from bench.evaluation import detection_eval, probes, scenarios
from bench.evaluation.tracegen import A100, H100, H100_PCIE, generate


def test_probes_are_named_once_and_never_part_of_the_catalog():
    names = [p.name for p in probes.PROBES]
    assert len(names) == len(set(names)) == len(probes.BY_NAME)
    # The suite's figures stay comparable: no probe is scored with the catalog.
    assert not set(names) & set(scenarios.BY_NAME)
    assert all(p not in scenarios.CATALOG for p in probes.PROBES)


def test_each_probe_builds_the_fleet_it_describes():
    specs = {p.name: p.build(0) for p in probes.PROBES}
    large = specs["probe_large_job"]
    assert len(large.nodes) == 48 and sum(len(g) for _, g in large.jobs[0].placement) == 384
    assert specs["probe_large_job_1s"].interval_s == 1.0 and len(specs["probe_large_job_1s"].nodes) == 48
    gpu10 = specs["probe_large_job_gpu10"].incidents[0]
    assert gpu10.kind == "slow_gpu" and abs(1.0 / gpu10.severity - 1.10) < 1e-9
    assert specs["probe_quiet_job"].noise_scale == probes.QUIET_NOISE_SCALE
    assert all(n.model is H100_PCIE and n.gpus == 4 for n in specs["probe_pcie_job"].nodes)
    assert all(n.model is A100 for n in specs["probe_a100_job"].nodes)
    for name, spec in specs.items():
        assert (spec.noise_scale == probes.NOISE_SCALE) == ("noise4" in name), name
        assert all(j.hpc_job is None for j in spec.jobs) == ("unattributed" in name), name
        # Only the one slowed GPU or node is the culprit: every probe is silent (no clocks, no bits).
        assert all(i.kind in ("slow_gpu", "slow_node", "host_starved", "comm_slowdown") for i in spec.incidents), name
    assert all(n.model is H100 for n in large.nodes)


def test_pcie_boards_report_no_nvlink_and_carry_the_collective_over_pcie():
    trace = generate(probes.BY_NAME["probe_pcie_job"].build(1))
    snaps = [orjson.loads(line) for line in trace.lines]
    gpus = [g for s in snaps for g in s["gpus"]]
    assert gpus and all(g["model"] == H100_PCIE.name for g in gpus)
    # NVML answers NOT_SUPPORTED without an NVLink bridge: the reading is null, never 0.
    assert all(g["nvlink_tx_bytes_total"] is None and g["nvlink_rx_bytes_total"] is None for g in gpus)
    # The intra-node collective crosses PCIe: far more than the few MB/s of a GPU's own host traffic.
    first = {(s["node"], g["index"]): (s["time"], g["pcie_tx_bytes_total"]) for s in reversed(snaps) for g in s["gpus"]}
    last = {(s["node"], g["index"]): (s["time"], g["pcie_tx_bytes_total"]) for s in snaps for g in s["gpus"]}
    rates = [(last[k][1] - first[k][1]) / (last[k][0] - first[k][0]) for k in first]
    assert min(rates) > 1e9
    # NVLink boards still report their counters.
    sxm = generate(probes.BY_NAME["probe_quiet_job"].build(0))
    assert all(isinstance(g["nvlink_tx_bytes_total"], int) for g in orjson.loads(sxm.lines[-1])["gpus"])


def test_a_probe_generates_and_is_scored_by_the_probe_evaluation():
    from gpufleet.server.replay import run_replay

    ev = detection_eval.evaluate_probes(run_replay, ["probe_quiet_job"], seeds=1)
    (row,) = ev.per_scenario
    assert row.name == "probe_quiet_job" and row.runs == 1 and row.required == 1
    # A straggler slowing a quiet job by 10-14 %: the margin floors, not the job's tiny spread, decide.
    assert ev.kinds["straggler"].required == 1 and ev.kinds["straggler"].detected == 1 and row.fp == 0
    body = detection_eval.render_probes(ev)
    assert "| probe_quiet_job |" in body and "`bench/evaluation/probes.py`" in body
    # Replaying nothing misses the straggler, and the section says so.
    silent = detection_eval.evaluate_probes(lambda lines: [], ["probe_quiet_job"], seeds=1)
    assert silent.kinds["straggler"].recall == 0.0
    assert "probe_quiet_job, seed 0, 5 s: missed straggler on" in detection_eval.render_probes(silent)


def test_probes_cli_refuses_catalog_names_and_other_conditions(capsys):
    for argv in (
        ["--probes", "--scenarios", "slow_node"],
        ["--probes", "--unattributed"],
        ["--probes", "--report"],
    ):
        with pytest.raises(SystemExit) as exc:
            detection_eval.main(argv)
        assert exc.value.code == 2, argv
    assert "unknown scenario(s) ['slow_node']" in capsys.readouterr().err


def test_probes_section_is_written_between_its_own_markers_after_the_report(tmp_path):
    doc = tmp_path / "evaluation.md"
    doc.write_text("# Evaluation\n\nintro\n")
    detection_eval.REPORT.write(doc, "report v1")
    detection_eval.PROBES.write(doc, "probes v1")
    detection_eval.PROBES.write(doc, "probes v2")
    detection_eval.REPORT.write(doc, "report v2")
    text = doc.read_text()
    assert text.count(detection_eval.PROBES.begin) == 1 and text.count(detection_eval.PROBES.heading) == 1
    assert "probes v2" in text and "probes v1" not in text and "report v2" in text
    assert text.index(detection_eval.REPORT.end) < text.index(detection_eval.PROBES.begin)
