"""deploy/prometheus/dcgm-recording-rules.yaml: dcgm-exporter's series recorded under gpufleet's names, labels and
units. Its `promtool test rules` cases ship in deploy/prometheus/tests/ (run by
tests/test_prometheus_rules.py::test_promtool_test_rules_passes_on_the_shipped_files); here, that they cover
every recorded name, that each name is one the agent exports, and that a wrong expectation fails them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.agent.running import PROMTOOL, requires_promtool

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "dcgm-recording-rules.yaml"
UNIT_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "dcgm-recording-rules.test.yaml"
DASHBOARD = ROOT / "dashboards" / "gpufleet.json"


def recorded() -> set[str]:
    return {rule["record"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}


def unit_tests() -> dict:
    return yaml.safe_load(UNIT_TESTS.read_text())


def test_every_recorded_name_is_one_the_agent_exports() -> None:
    # A name the agent does not export is one no panel reads: the dashboard queries the agent's names.
    documented = set(re.findall(r"^\| `(gpufleet_\w+)`", (ROOT / "docs" / "agent.md").read_text(), re.M))
    assert recorded() <= documented, sorted(recorded() - documented)


def test_the_shipped_unit_tests_check_every_recorded_name() -> None:
    exprs = " ".join(case["expr"] for group in unit_tests()["tests"] for case in group["promql_expr_test"])
    assert {name for name in recorded() if not re.search(rf"\b{name}\b", exprs)} == set()


def test_the_shipped_unit_tests_check_the_dashboards_throttle_query_on_dcgm_field_64() -> None:
    panel_exprs = re.findall(r'"expr": "(gpufleet_gpu_throttle_active[^"]*)"', DASHBOARD.read_text())
    assert panel_exprs, "the dashboard has no throttle panel"
    cases = [
        (group, case)
        for group in unit_tests()["tests"]
        for case in group["promql_expr_test"]
        if case["expr"].startswith("gpufleet_gpu_throttle_active{")
    ]
    assert any(
        any(
            s["series"].startswith("DCGM_FI_DEV_CLOCKS_EVENT_REASONS{") and s["values"] == "64x10"
            for s in g["input_series"]
        )
        and 'reason="hw_thermal_slowdown"' in case["exp_samples"][0]["labels"]
        for g, case in cases
    )


@requires_promtool
def test_a_wrong_unit_fails(tmp_path: Path) -> None:
    # Guards the guard: the shipped cases with the SM clock expected in MHz instead of Hz must fail.
    doc = unit_tests()
    doc["rule_files"] = [str(RULES)]
    for case in doc["tests"][0]["promql_expr_test"]:
        if case["expr"] == 'gpufleet_gpu_clock_hertz{clock="sm"}':
            case["exp_samples"][0]["value"] = 1980
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "1.98E+09" in done.stdout + done.stderr
