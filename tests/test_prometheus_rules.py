"""The shipped Prometheus alerting rules (deploy/prometheus/gpufleet-rules.yaml), judged by Prometheus's
own tools: `promtool check rules`, `promtool test rules` over the unit tests shipped in
deploy/prometheus/tests/ (every rule fires where it should and stays quiet just short of it), and a real
Prometheus loading the file while it scrapes a real agent and server.

A rule that never fires is worse than none: it reads as "all is well". Rules break silently when a metric
or label is renamed, when a threshold sits on the wrong side of a ratio, or when a template does not
render; each of those fails here.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import httpx
import pytest
import yaml

from tests.agent.running import (
    PROMTOOL,
    agent_process,
    prometheus_process,
    requires_prometheus,
    requires_promtool,
    server_process,
)

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "gpufleet-rules.yaml"
# promtool unit tests of every rule: each fires where it should and stays quiet just short of it.
UNIT_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "gpufleet-rules.test.yaml"
# A healthy demo agent counts no error, and an empty family is not exported at all.
ONCE_COUNTED = {"gpufleet_agent_errors_total"}
DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.5


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def unit_tests() -> dict:
    return yaml.safe_load(UNIT_TESTS.read_text())


def test_every_rule_has_a_firing_and_a_quiet_case() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))
    cases = [case for group in unit_tests()["tests"] for case in group["alert_rule_test"]]
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == set(names)
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == set(names)


def test_every_rule_says_what_to_do() -> None:
    for rule in rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_series_exported_only_once_counted_are_the_agents() -> None:
    exposition = (RULES.parents[2] / "agent" / "exposition.py").read_text()
    for name in ONCE_COUNTED:
        assert f'Family("{name.removesuffix("_total")}", "counter"' in exposition, name


@requires_promtool
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


@requires_promtool
def test_promtool_test_rules_passes_on_the_shipped_files() -> None:
    """`promtool test rules deploy/prometheus/tests/*.yaml`, as a user runs it from the repository root."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "deploy" / "prometheus" / "tests").glob("*.yaml"))
    assert len(files) >= 2
    result = subprocess.run([PROMTOOL, "test", "rules", *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files), result.stdout


@requires_promtool
def test_promtool_unit_tests_catch_a_wrong_expectation(tmp_path: Path) -> None:
    # Guards the guard: the shipped cases with one firing case expecting silence must fail.
    doc = unit_tests()
    doc["rule_files"] = [str(RULES)]
    case = next(c for group in doc["tests"] for c in group["alert_rule_test"] if c["exp_alerts"])
    case["exp_alerts"] = []
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(doc))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert case["alertname"] in result.stdout + result.stderr


@requires_prometheus
def test_rules_load_and_read_what_agent_and_server_export(tmp_path: Path) -> None:
    """On a real Prometheus scraping a real agent and server: every rule is loaded and evaluates without
    error, names only exported metrics, and none is pending while all is well. Then the server stops and
    the rule about it goes pending (its `for` keeps it from firing within a test)."""
    with agent_process("--simulate", "demo", "--node", "dgx-01") as (_, agent_port), contextlib.ExitStack() as server:
        _, server_port = server.enter_context(
            server_process(
                tmp_path, "--targets", f"127.0.0.1:{agent_port}", "--pull.interval", "1s", "--pull.timeout", "1s"
            )
        )
        with prometheus_process(tmp_path, [agent_port], servers=[server_port], rule_files=[RULES]) as (
            prom,
            prom_port,
            log_path,
        ):
            api = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}/api/v1", timeout=10)
            waiter = threading.Event()

            def until(what: str, check: Callable[[], bool]) -> None:
                for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
                    assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
                    if check():
                        return
                    waiter.wait(POLL_SECONDS)
                pytest.fail(f"never within {DEADLINE_SECONDS} s: {what}")

            def query(expr: str) -> list:
                return api.get("/query", params={"query": expr}).json()["data"]["result"]

            def groups() -> list[dict]:
                return api.get("/rules").json()["data"]["groups"]

            until(
                "the server ticked, pulled the agent, and Prometheus scraped both",
                lambda: bool(
                    query("gpufleet_server_engine_last_tick_timestamp_seconds")
                    and query("gpufleet_agent_sample_age_seconds")
                    and query("gpufleet_server_target_up == 1")
                ),
            )
            scraped = time.time()
            until(
                "both rule groups evaluated over those scrapes",
                lambda: len(groups()) == 2 and all(_unix(g["lastEvaluation"]) > scraped for g in groups()),
            )

            exported = set()
            for port in (agent_port, server_port):
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M):
                    exported |= {name, f"{name}_total"} if kind == "counter" else {name}
            loaded = [rule for group in groups() for rule in group["rules"]]
            assert sorted(r["name"] for r in loaded) == sorted(r["alert"] for r in rules())
            for rule in loaded:
                assert rule["health"] == "ok", rule
                unknown = set(re.findall(r"gpufleet_\w+", rule["query"])) - exported - ONCE_COUNTED
                assert not unknown, f"{rule['name']}: no such metric {sorted(unknown)}"
            assert api.get("/alerts").json()["data"]["alerts"] == []

            server.close()
            until(
                "GpufleetServerDown pending once the server stopped",
                lambda: (
                    [
                        a["state"]
                        for a in api.get("/alerts").json()["data"]["alerts"]
                        if a["labels"]["alertname"] == "GpufleetServerDown"
                    ]
                    == ["pending"]
                ),
            )


def _unix(rfc3339: str) -> float:
    """Prometheus's nanosecond RFC 3339 times, to the microsecond datetime reads."""
    whole, _, rest = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(rest or '0')[:6]}+00:00").timestamp()
