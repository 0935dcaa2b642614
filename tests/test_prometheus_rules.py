"""The shipped Prometheus alerting rules (deploy/prometheus/gpufleet-rules.yaml), judged by Prometheus's
own tools: `promtool check rules`, `promtool test rules` over series written here for every rule (each
must fire where it should and stay quiet just short of it), and a real Prometheus loading the file while
it scrapes a real agent and server.

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
from dataclasses import dataclass, field
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

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "gpufleet-rules.yaml"
# Not the static config's job name: the rules must not depend on it (a ServiceMonitor names it NAMESPACE/NAME).
SERVER = 'job="monitoring/gpufleet-server", instance="srv:9472"'
AGENT = 'job="gpufleet-agent", instance="dgx-01:9471", node="dgx-01"'
# A healthy demo agent counts no error, and an empty family is not exported at all.
ONCE_COUNTED = {"gpufleet_agent_errors_total"}
DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.5


def on_server(summary: str, severity: str, **labels: str) -> tuple[dict[str, str], str]:
    """An alert expected about the server of SERVER: its labels besides alertname, and its summary."""
    return {"job": "monitoring/gpufleet-server", "instance": "srv:9472", **labels, "severity": severity}, summary


def on_agent(summary: str, severity: str, **labels: str) -> tuple[dict[str, str], str]:
    """The same about the agent of AGENT."""
    return {
        "job": "gpufleet-agent",
        "instance": "dgx-01:9471",
        "node": "dgx-01",
        **labels,
        "severity": severity,
    }, summary


@dataclass(frozen=True)
class Case:
    """Series sampled every minute (promtool's expanding notation), and at `at` minutes the alerts of
    `alert` expected to fire: their labels (besides alertname) and rendered summary."""

    alert: str
    series: dict[str, str]
    at: int
    firing: list[tuple[dict[str, str], str]] = field(default_factory=list)


CASES = [
    # Down from minute 2, `for: 2m`: pending at 3, firing at 5.
    Case("GpufleetServerDown", {f"up{{{SERVER}}}": "1 1 0x10", f"gpufleet_server_build_info{{{SERVER}}}": "1 1"}, 3),
    # An agent that is down is not a server: only targets that exported the server's build info count.
    Case(
        "GpufleetServerDown",
        {
            f"up{{{SERVER}}}": "1 1 0x10",
            f"gpufleet_server_build_info{{{SERVER}}}": "1 1",
            'up{job="gpufleet-agent", instance="a"}': "0x12",
        },
        5,
        [on_server("gpufleet-server srv:9472 does not answer scrapes", "critical")],
    ),
    Case("GpufleetServerAbsent", {f"gpufleet_server_build_info{{{SERVER}}}": "1x20"}, 15),
    Case(
        "GpufleetServerAbsent",
        {'up{job="gpufleet-agent", instance="a"}': "1x20"},
        11,
        [({"severity": "critical"}, "Prometheus has no gpufleet-server target to scrape")],
    ),
    # The last tick is 300 s into the test, then frozen: 120 s late from minute 7, `for: 2m`.
    Case(
        "GpufleetEngineStalled", {f"gpufleet_server_engine_last_tick_timestamp_seconds{{{SERVER}}}": "0+60x5 300x20"}, 8
    ),
    Case(
        "GpufleetEngineStalled",
        {f"gpufleet_server_engine_last_tick_timestamp_seconds{{{SERVER}}}": "0+60x5 300x20"},
        10,
        [on_server("gpufleet-server srv:9472 has not evaluated its engine for 5m 0s", "critical")],
    ),
    Case("GpufleetEngineStalled", {f"gpufleet_server_engine_last_tick_timestamp_seconds{{{SERVER}}}": "0+60x30"}, 30),
    Case("GpufleetCyclesFailing", {f"gpufleet_server_cycle_failures_total{{{SERVER}}}": "0x10 0x10"}, 20),
    Case(
        "GpufleetCyclesFailing",
        {f"gpufleet_server_cycle_failures_total{{{SERVER}}}": "0x14 1x6"},
        20,
        [on_server("gpufleet-server srv:9472 had 1 failed cycles in 10 minutes", "warning")],
    ),
    # 5 s pulls are 12 cycles a minute: 1 overrun a minute is 8 %, 3 are 25 %.
    Case(
        "GpufleetFallingBehind",
        {
            f"gpufleet_server_cycles_total{{{SERVER}}}": "0+12x40",
            f"gpufleet_server_cycle_overruns_total{{{SERVER}}}": "0+1x40",
        },
        40,
    ),
    Case(
        "GpufleetFallingBehind",
        {
            f"gpufleet_server_cycles_total{{{SERVER}}}": "0+12x40",
            f"gpufleet_server_cycle_overruns_total{{{SERVER}}}": "0x10 3+3x29",
        },
        30,
        [on_server("gpufleet-server srv:9472 overruns its pull interval in 25% of cycles", "warning")],
    ),
    # Over a quarter, and at least three: in a small fleet one or two nodes down are their own alerts.
    Case(
        "GpufleetAgentsUnreachable",
        {
            f'gpufleet_server_target_up{{{SERVER}, target="{t}"}}': v
            for t, v in zip("abcdefghijkl", ["0x10"] * 3 + ["1x10"] * 9)
        },
        10,
    ),
    Case(
        "GpufleetAgentsUnreachable",
        {
            f'gpufleet_server_target_up{{{SERVER}, target="{t}"}}': v
            for t, v in zip("abcd", ("0x10", "0x10", "1x10", "1x10"))
        },
        10,
    ),
    Case(
        "GpufleetAgentsUnreachable",
        {
            f'gpufleet_server_target_up{{{SERVER}, target="{t}"}}': v
            for t, v in zip("abcd", ("0x10", "0x10", "0x10", "1x10"))
        },
        6,
        [on_server("gpufleet-server srv:9472 cannot pull 75% of its agents", "critical")],
    ),
    # Unreachable agents are the node_unreachable alert's business, not this one's.
    Case(
        "GpufleetPayloadsRejected",
        {
            f'gpufleet_server_rejected_total{{{SERVER}, reason="timeout"}}': "0x10 2+2x9",
            f'gpufleet_server_rejected_total{{{SERVER}, reason="connect"}}': "0x10 2+2x9",
        },
        20,
    ),
    Case(
        "GpufleetPayloadsRejected",
        {
            f'gpufleet_server_rejected_total{{{SERVER}, reason="timeout"}}': "0x10 2+2x9",
            f'gpufleet_server_rejected_total{{{SERVER}, reason="schema"}}': "0x10 2+2x9",
        },
        20,
        [on_server("gpufleet-server srv:9472 rejected 20 pulls or snapshots (schema)", "warning", reason="schema")],
    ),
    Case(
        "GpufleetAgentClockSkew", {f'gpufleet_server_target_clock_offset_seconds{{{SERVER}, target="a"}}': "-30x30"}, 14
    ),
    Case(
        "GpufleetAgentClockSkew",
        {
            f'gpufleet_server_target_clock_offset_seconds{{{SERVER}, target="a"}}': "-30x30",
            f'gpufleet_server_target_clock_offset_seconds{{{SERVER}, target="b"}}': "9x30",
        },
        16,
        [on_server("The clock of agent a is 30 s off the server's", "warning", target="a")],
    ),
    Case(
        "GpufleetNotificationsFailing",
        {
            f'gpufleet_server_notifications_failed_total{{{SERVER}, notifier="alertmanager", url="http://am:9093"}}': "0x10 1+1x20"
        },
        14,
    ),
    Case(
        "GpufleetNotificationsFailing",
        {
            f'gpufleet_server_notifications_failed_total{{{SERVER}, notifier="alertmanager", url="http://am:9093"}}': "0x10 1+1x20"
        },
        25,
        [
            on_server(
                "gpufleet-server srv:9472 cannot deliver alerts to alertmanager http://am:9093",
                "critical",
                notifier="alertmanager",
                url="http://am:9093",
            )
        ],
    ),
    Case(
        "GpufleetNotificationsDropped",
        {f'gpufleet_server_notifications_dropped_total{{{SERVER}, notifier="webhook", url="http://hook"}}': "0x20"},
        20,
    ),
    Case(
        "GpufleetNotificationsDropped",
        {
            f'gpufleet_server_notifications_dropped_total{{{SERVER}, notifier="webhook", url="http://hook"}}': "0x10 5x10"
        },
        15,
        [
            on_server(
                "gpufleet-server srv:9472 dropped 5 alerts for webhook http://hook",
                "critical",
                notifier="webhook",
                url="http://hook",
            )
        ],
    ),
    Case("GpufleetStoreErrors", {f"gpufleet_server_store_errors_total{{{SERVER}}}": "0x20"}, 20),
    Case(
        "GpufleetStoreErrors",
        {f"gpufleet_server_store_errors_total{{{SERVER}}}": "0x10 1x10"},
        15,
        [on_server("gpufleet-server srv:9472 cannot write its alert store", "warning")],
    ),
    # A few blind cycles (a Prometheus restart) are no incident; five minutes are.
    Case("GpufleetBlind", {f"gpufleet_server_blind{{{SERVER}}}": "0x5 1x3 0x10"}, 10),
    Case(
        "GpufleetBlind",
        {f"gpufleet_server_blind{{{SERVER}}}": "0x2 1x15"},
        10,
        [on_server("gpufleet-server srv:9472 has had no usable GPU sample for 5 minutes", "critical")],
    ),
    Case("GpufleetAgentNvmlDown", {f"gpufleet_agent_nvml_up{{{AGENT}}}": "1 1 0x10"}, 3),
    Case(
        "GpufleetAgentNvmlDown",
        {f"gpufleet_agent_nvml_up{{{AGENT}}}": "1 1 0x10"},
        5,
        [on_agent("gpufleet-agent on dgx-01 cannot read NVML", "critical")],
    ),
    Case("GpufleetAgentSamplingStuck", {f"gpufleet_agent_sample_age_seconds{{{AGENT}}}": "1x3 29x10"}, 10),
    Case(
        "GpufleetAgentSamplingStuck",
        {f"gpufleet_agent_sample_age_seconds{{{AGENT}}}": "1x3 60x10"},
        7,
        [on_agent("gpufleet-agent on dgx-01 took its last sample 1m 0s ago", "critical")],
    ),
    # An NVML reading unsupported or failing on one GPU is the reading's own business (reading_supported).
    Case(
        "GpufleetAgentErrors",
        {f'gpufleet_agent_errors_total{{{AGENT}, reading="sm_active", error="Unknown"}}': "0x10 1+1x10"},
        20,
    ),
    Case(
        "GpufleetAgentErrors",
        {
            f'gpufleet_agent_errors_total{{{AGENT}, reading="sm_active", error="Unknown"}}': "0x10 1+1x10",
            f'gpufleet_agent_errors_total{{{AGENT}, reading="attribution", error="environ:EACCES"}}': "0x10 1+1x10",
        },
        20,
        [
            on_agent(
                "gpufleet-agent on dgx-01 reports attribution errors (environ:EACCES)",
                "warning",
                reading="attribution",
                error="environ:EACCES",
            )
        ],
    ),
]


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_rule_has_a_firing_and_a_quiet_case() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))
    assert {c.alert for c in CASES if c.firing} == set(names)
    assert {c.alert for c in CASES if not c.firing} == set(names)


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
def test_promtool_unit_tests(tmp_path: Path) -> None:
    # promtool compares annotations exactly: the long descriptions are left out of the copy it tests, so
    # each case states the rendered summary only. Expressions, `for` and labels are the shipped ones.
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
            "alert_rule_test": [
                {
                    "eval_time": f"{case.at}m",
                    "alertname": case.alert,
                    "exp_alerts": [
                        {"exp_labels": labels, "exp_annotations": {"summary": summary}}
                        for labels, summary in case.firing
                    ],
                }
            ],
        }
        for case in CASES
    ]
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@requires_promtool
def test_promtool_unit_tests_catch_a_wrong_expectation(tmp_path: Path) -> None:
    # Guards the guard: a case expecting silence where the rule fires must fail.
    case = next(c for c in CASES if c.firing)
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                        "alert_rule_test": [{"eval_time": f"{case.at}m", "alertname": case.alert, "exp_alerts": []}],
                    }
                ],
            }
        )
    )
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert case.alert in result.stdout + result.stderr


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
