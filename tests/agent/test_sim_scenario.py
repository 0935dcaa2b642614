"""Scenario loading and validation."""

from __future__ import annotations

import copy
import json

import pytest

from gpufleet.agent.sim import BUILTIN_SCENARIOS, ScenarioError, load_scenario
from gpufleet.agent.sim.scenario import parse_scenario

BASE = {
    "name": "t",
    "nodes": [{"name": "n1", "model": "h100-sxm", "gpus": 8}, {"name": "n2", "model": "a100", "gpus": 4}],
    "jobs": [{"id": 42, "nodes": ["n1", {"node": "n2", "gpus": [0, 1]}]}],
    "incidents": [{"kind": "slow_gpu", "node": "n1", "gpu": 3, "start_s": 10, "end_s": 20}],
}


def _with(path: str, value):
    """BASE with the value at a dotted/indexed path replaced (value None deletes the key)."""
    doc = copy.deepcopy(BASE)
    target = doc
    parts = path.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    last = parts[-1]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return doc


@pytest.mark.parametrize("name", BUILTIN_SCENARIOS)
def test_every_builtin_loads(name):
    scenario = load_scenario(name)
    assert scenario.name == name
    assert scenario.nodes


def test_demo_layout():
    demo = load_scenario("demo")
    assert demo.nodes == ("dgx-01", "dgx-02", "dgx-03", "dgx-04")
    assert {j.id: j.nodes for j in demo.jobs} == {"71001": ("dgx-01", "dgx-02"), "71002": ("dgx-03", "dgx-04")}
    kinds = {i.kind: i for i in demo.incidents}
    assert kinds["cooling_failure"].gpus == (("dgx-02", 5),)
    assert kinds["slow_gpu"].gpus == (("dgx-03", 2),) and kinds["slow_gpu"].silent
    assert kinds["comm_slowdown"].job == "71002"


def test_cluster_incidents_covers_every_kind():
    from gpufleet.agent.sim.scenario import INCIDENT_KINDS

    assert {i.kind for i in load_scenario("cluster-incidents").incidents} == set(INCIDENT_KINDS)


def test_job_placement_and_ids():
    scenario = parse_scenario(BASE)
    job = scenario.jobs[0]
    assert job.id == "42"
    assert job.gpus == tuple(("n1", i) for i in range(8)) + (("n2", 0), ("n2", 1))
    assert job.nodes == ("n1", "n2")


def test_scenario_is_frozen():
    scenario = parse_scenario(BASE)
    with pytest.raises(AttributeError):
        scenario.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("nodes.0.model", "h200-nvl", "nodes[0].model: unknown GPU model 'h200-nvl'"),
        ("nodes.0.gpus", 0, "nodes[0].gpus: must be >= 1"),
        ("nodes.0.gpus", "eight", "nodes[0].gpus: expected an integer"),
        ("nodes.1.name", "n1", "duplicate node name 'n1'"),
        ("nodes.0.colour", "red", "nodes[0].colour: unknown key"),
        ("jobs.0.nodes", ["n9"], "jobs[0].nodes[0]: unknown node 'n9'"),
        ("jobs.0.end_s", -5, "jobs[0].end_s: must be after start_s"),
        ("jobs.0.compute_fraction", 1.5, "jobs[0].compute_fraction: must be <= 0.99"),
        ("jobs.0.compute_intensity", 0, "jobs[0].compute_intensity: must be >= 0.05"),
        ("jobs.0.compute_intensity", "high", "jobs[0].compute_intensity: expected a number"),
        ("jobs.0.id", None, "jobs[0].id: required key is missing"),
        ("jobs.0.scheduler", "pbs", "jobs[0].scheduler: must be one of slurm, kubernetes, got 'pbs'"),
        ("incidents.0.kind", "meteor", "incidents[0].kind: unknown incident kind 'meteor'"),
        ("incidents.0.gpu", 8, "incidents[0].gpu: GPU index 8 does not exist on node 'n1'"),
        ("incidents.0.speed_factor", 0, "incidents[0].speed_factor: must be >= 0.05"),
        ("incidents.0.speed_facter", 0.5, "incidents[0].speed_facter: unknown key"),
        ("incidents.0.start_s", None, "incidents[0].start_s: required key is missing"),
        ("incidents.0.start_s", "soon", "incidents[0].start_s: expected a number"),
        ("incidents.0.end_s", 5, "incidents[0].end_s: must be after start_s"),
        ("incidents.0.job", "42", "incidents[0].job: this incident kind targets a node or GPUs"),
        ("incidents.0.power_brake", "yes", "incidents[0].power_brake: expected true or false"),
    ],
)
def test_invalid_values_are_named(path, value, message):
    with pytest.raises(ScenarioError) as info:
        parse_scenario(_with(path, value), source="s.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("s.yaml: ")


def test_silent_power_brake_contradiction():
    doc = _with("incidents.0.power_brake", True)
    doc["incidents"][0]["silent"] = True
    with pytest.raises(ScenarioError, match="silent slow GPU cannot also show power_brake"):
        parse_scenario(doc)


def test_gpu_double_booked_across_jobs():
    doc = copy.deepcopy(BASE)
    doc["jobs"].append({"id": "43", "nodes": [{"node": "n1", "gpus": [7]}], "start_s": 100})
    with pytest.raises(ScenarioError, match=r"jobs\[1\].nodes: GPU n1/7 already runs job '42'"):
        parse_scenario(doc)
    doc["jobs"][0]["end_s"] = 100
    assert len(parse_scenario(doc).jobs) == 2


def test_comm_slowdown_needs_known_job():
    doc = copy.deepcopy(BASE)
    doc["incidents"] = [{"kind": "comm_slowdown", "job": "99", "start_s": 0}]
    with pytest.raises(ScenarioError, match="incidents\\[0\\].job: unknown job '99'"):
        parse_scenario(doc)


def test_counter_reset_has_no_end():
    doc = copy.deepcopy(BASE)
    doc["incidents"] = [{"kind": "counter_reset", "node": "n1", "start_s": 5, "end_s": 9}]
    with pytest.raises(ScenarioError, match="counter_reset happens at start_s"):
        parse_scenario(doc)


def test_power_cap_on_job_resolves_to_its_gpus():
    doc = copy.deepcopy(BASE)
    doc["incidents"] = [{"kind": "power_cap", "job": 42, "start_s": 0, "watts": 400}]
    inc = parse_scenario(doc).incidents[0]
    assert inc.job == "42" and len(inc.gpus) == 10 and inc.watts == 400


def test_top_level_must_be_mapping():
    with pytest.raises(ScenarioError, match="expected a mapping"):
        parse_scenario([1, 2])


def test_load_from_json_and_yaml_files(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(BASE))
    assert load_scenario(path).nodes == ("n1", "n2")
    ypath = tmp_path / "s.yml"
    ypath.write_text("name: y\nnodes:\n  - {name: only, model: l40s, gpus: 2}\n")
    assert load_scenario(str(ypath)).node("only").gpu_count == 2


def test_unreadable_inputs(tmp_path):
    with pytest.raises(ScenarioError, match="neither a built-in"):
        load_scenario("no-such-scenario")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(ScenarioError, match="bad.yaml: not valid YAML"):
        load_scenario(bad)
    txt = tmp_path / "s.txt"
    txt.write_text("{}")
    with pytest.raises(ScenarioError, match="must end in .yaml"):
        load_scenario(txt)


def test_unknown_node_lookup():
    with pytest.raises(ScenarioError, match="node 'zz' is not in scenario"):
        load_scenario("demo").node("zz")
