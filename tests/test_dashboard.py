"""The shipped Grafana dashboard against what it reads: every query run on a real Prometheus scraping two
real agents (demo nodes of two jobs) and an HA pair of real servers pulling them both, over loopback.

A dashboard is only as good as its queries: a renamed metric, a join that matches many-to-many or a
typo in a label shows as an empty panel, which nobody notices until an incident. Grafana's own
variables are substituted as Grafana would with "All" selected.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

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
from tests.dcgm_exposition import Fleet, Gpu

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "gpufleet.json"
DEADLINE_SECONDS = 90.0
POLL_SECONDS = 0.5
GPUS = 16  # two demo nodes of 8 GPUs
# Panels that have data whenever agents and server run; the rest may rightly be empty (no alert firing,
# no throttling, no rejected payload, no job baseline yet), but their queries must still be valid.
ALWAYS = {
    "SM activity per GPU": (0.0, 1.0),
    "Utilization per GPU": (0.0, 1.0),
    "Power per GPU": (10.0, 800.0),
    "SM clock per GPU": (1e8, 3e9),
    "Temperature": (20.0, 100.0),
    "HBM temperature": (20.0, 110.0),
    "Stragglers by job": (0.0, 0.0),
    "Communication- / input-bound": (0.0, 1.0),
    "Agents up": (2.0, 2.0),
    "Pull cycle and engine tick": (0.0, 5.0),
    "Memory used per GPU": (1e9, 100e9),
    "Power limit per GPU": (100.0, 1000.0),
    "NVLink traffic per GPU": (0.0, 1e12),
    "PCIe traffic per GPU": (0.0, 1e11),
}
PER_GPU = {
    "SM activity per GPU",
    "Utilization per GPU",
    "Power per GPU",
    "SM clock per GPU",
    "Memory used per GPU",
    "Power limit per GPU",
}
# Families exported from their first event on (docs/agent.md): none on healthy demo agents.
FIRST_EVENT = {"gpufleet_gpu_xid_errors_total"}
# Per-GPU panels that name each GPU's job and follow the Job variable.
JOINED = ("SM activity per GPU", "Utilization per GPU", "Power per GPU", "Memory used per GPU")
# Panels of the servers' own job series: one series per job (and query), however many replicas report it.
PER_JOB = {"Stragglers by job", "Communication- / input-bound"}


def panels(doc: dict) -> list[dict]:
    out = []
    for panel in doc["panels"]:
        out.append(panel)
        out.extend(panels(panel) if "panels" in panel else [])
    return out


def panel_exprs(doc: dict, title: str) -> list[str]:
    """The queries of the panel so titled, as Grafana sends them."""
    (panel,) = [p for p in panels(doc) if p.get("title") == title]
    return [grafana(target["expr"]) for target in panel["targets"]]


def grafana(expr: str, hpc_job: str = ".*") -> str:
    """The query Grafana sends with every variable at All (allValue `.*`), or the Job variable at `hpc_job`,
    1 s scrapes and the last hour shown."""
    return (
        expr.replace("$node", ".*")
        .replace("$hpc_job", hpc_job)
        .replace("$__rate_interval", "10s")
        .replace("$__range", "1h")
    )


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_panels_are_well_formed(dashboard: dict) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "node", "hpc_job", "gpufleet_url"}


# Panels that count events: with nothing to count their query returns no series, and the truth is 0.
COUNTS = (
    "Firing alerts by kind",
    "Rejected pulls/snapshots by reason",
    "GPU-hours lost in the time range, by job and cause",
)


def test_panels_that_count_show_zero_not_no_data(dashboard: dict) -> None:
    by_title = {p.get("title"): p for p in panels(dashboard)}
    for title in COUNTS:
        assert by_title[title]["fieldConfig"]["defaults"].get("noValue") == "0", title


def test_alert_links_open_on_the_gpufleet_server_not_on_the_grafana_host(dashboard: dict) -> None:
    (url_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "gpufleet_url"]
    assert url_var["type"] == "textbox" and re.match(r"^https?://", url_var["query"])
    links = [
        link["url"] for p in panels(dashboard) for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])
    ]
    assert links and all(link.startswith("${gpufleet_url}/") for link in links), links


@requires_prometheus
def test_every_query_runs_on_real_prometheus_and_the_panels_have_data(dashboard: dict, tmp_path) -> None:
    """Two servers pull the same agents, as an HA pair does: every panel shows each agent, job and alert
    once, not once per replica."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        agent_process("--simulate", "demo", "--node", "dgx-01") as (_, port_a),
        agent_process("--simulate", "demo", "--node", "dgx-03") as (_, port_b),
        server_process(
            tmp_path / "a",
            "--targets",
            f"127.0.0.1:{port_a},127.0.0.1:{port_b}",
            "--pull.interval",
            "1s",
            "--pull.timeout",
            "1s",
        ) as (_, port_s),
        server_process(
            tmp_path / "b",
            "--targets",
            f"127.0.0.1:{port_a},127.0.0.1:{port_b}",
            "--pull.interval",
            "1s",
            "--pull.timeout",
            "1s",
        ) as (_, port_t),
        prometheus_process(tmp_path, [port_a, port_b], servers=[port_s, port_t]) as (prom, prom_port, log_path),
    ):
        api = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}/api/v1", timeout=10)

        def query(expr: str) -> list[dict]:
            answer = api.get("/query", params={"query": expr}).json()
            assert answer["status"] == "success", (expr, answer)
            return answer["data"]["result"]

        # Until every panel can have data: a rate needs two scrapes, job gauges need an engine tick.
        waiter = threading.Event()
        counted = jobs = 0
        for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
            assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
            try:
                counted = len(query("count_over_time(gpufleet_gpu_active_seconds_total[10s]) >= 3"))
                jobs = len(query("gpufleet_job_stragglers"))
            except httpx.TransportError:  # Prometheus not listening yet
                counted = jobs = 0
            if counted == 2 * GPUS and jobs == 2 * 2:  # two readings per GPU; two jobs per server
                break
            waiter.wait(POLL_SECONDS)
        else:
            pytest.fail(
                f"Prometheus never had three scrapes of both agents ({counted} of {2 * GPUS} series) "
                f"and the servers' job gauges ({jobs} of 2 jobs on each of 2 servers)"
            )

        exported = set()
        for port in (port_a, port_b, port_s, port_t):
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M):
                exported |= {name, f"{name}_total"} if kind == "counter" else {name}
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
                values = api.get(f"/label/{label}/values", params={"match[]": metric}).json()["data"]
                assert values == {"node": ["dgx-01", "dgx-03"], "hpc_job": ["71001", "71002"]}[label], (
                    variable["definition"],
                    values,
                )

        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                expr = grafana(target["expr"])
                unknown = set(re.findall(r"gpufleet_\w+", expr)) - exported - FIRST_EVENT
                assert not unknown, f"{panel['title']}: no such metric {sorted(unknown)}"
                result = query(expr)
                if panel["title"] not in ALWAYS:
                    continue
                assert result, f"{panel['title']}: empty ({expr})"
                low, high = ALWAYS[panel["title"]]
                for series in result:
                    assert low <= float(series["value"][1]) <= high, (panel["title"], series)
                if panel["title"] in PER_GPU:
                    keys = {(s["metric"]["node"], s["metric"]["gpu"]) for s in result}
                    assert len(keys) == len(result) == GPUS, (panel["title"], [s["metric"] for s in result])
                    if "hpc_job" in expr:
                        assert {s["metric"]["hpc_job"] for s in result} == {"71001", "71002"}, panel["title"]
                if panel["title"] in PER_JOB:
                    assert sorted(s["metric"]["hpc_job"] for s in result) == ["71001", "71002"], (
                        panel["title"],
                        expr,
                        [s["metric"] for s in result],
                    )


def promql_expr_tests(tmp_path: Path, series: dict[str, str], expected: list[dict]) -> None:
    """Run promtool's promql_expr_test of `expected` over `series` (1 m apart), asserting it passes."""
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(
            {
                "rule_files": [],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [{"series": k, "values": v} for k, v in series.items()],
                        "promql_expr_test": expected,
                    }
                ],
            }
        )
    )
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@requires_promtool
def test_per_gpu_panels_keep_a_gpu_that_no_job_uses(dashboard: dict, tmp_path) -> None:
    """GPU 0 runs job 71001, GPU 1 nothing (idle, or just freed): with Job at All both show, GPU 1 without a
    job; with Job at 71001, GPU 0 alone. Gauges only, as from an agent's first scrapes: every fallback of
    the panels' queries is taken."""
    series = {}
    for gpu in ("0", "1"):
        ids = f'node="dgx-01", gpu="{gpu}", uuid="GPU-{gpu}"'
        series[f"gpufleet_gpu_up{{{ids}}}"] = "1x5"
        for name, value in [
            ("gpufleet_gpu_sm_active_ratio", "0.5"),
            ("gpufleet_gpu_utilization_ratio", "0.5"),
            ("gpufleet_gpu_power_watts", "500"),
            ("gpufleet_gpu_memory_used_bytes", "2e10"),
        ]:
            series[f"{name}{{{ids}}}"] = f"{value}x5"
    series['gpufleet_gpu_job_info{node="dgx-01", gpu="0", uuid="GPU-0", hpc_job="71001"}'] = "1x5"
    expected = []
    for title in JOINED:
        (panel,) = [p for p in panels(dashboard) if p.get("title") == title]
        expr = panel["targets"][0]["expr"]
        for job, gpus in ((".*", [("0", ', hpc_job="71001"'), ("1", "")]), ("71001", [("0", ', hpc_job="71001"')])):
            expected.append(
                {
                    "expr": grafana(expr, hpc_job=job),
                    "eval_time": "4m",
                    "exp_samples": [
                        {"labels": f'{{node="dgx-01", gpu="{gpu}", uuid="GPU-{gpu}"{job_label}}}', "value": value}
                        for gpu, job_label in gpus
                        for value in [{"Power per GPU": 500, "Memory used per GPU": 2e10}.get(title, 0.5)]
                    ],
                }
            )
    promql_expr_tests(tmp_path, series, expected)


@requires_promtool
def test_an_ha_pair_shows_each_alert_once(dashboard: dict, tmp_path) -> None:
    """The alert panels over two replicas' series (no alert fires in the live test above): an alert both
    replicas hold is one row and counts once; one that only one replica holds yet (it saw the incident
    a tick sooner) is there too."""
    both = {
        "straggler": ("warning", "n1", "3", "71001", "gpu_clocks_cut+hw_slowdown_or_power_brake", "st-1"),
        "thermal_throttle": ("critical", "n2", "5", "", "temperature+hw_thermal_slowdown", "th-1"),
    }
    names = ("kind", "severity", "node", "gpu", "hpc_job", "cause", "alert_id")
    series = {}
    for replica in ("srv-0:9472", "srv-1:9472"):
        server = f'job="gpufleet-server", instance="{replica}"'
        for kind, row in both.items():
            series[f'gpufleet_alerts{{{server}, kind="{kind}", severity="{row[0]}", state="firing"}}'] = "1x5"
            series[
                "gpufleet_alert_active{"
                + server
                + ", "
                + ", ".join(f'{k}="{v}"' for k, v in zip(names, (kind, *row)))
                + "}"
            ] = "1x5"
    first = 'job="gpufleet-server", instance="srv-0:9472"'
    late = ("critical", "n4", "", "71002", "host_idle", "st-2")
    series[f'gpufleet_alerts{{{first}, kind="straggler", severity="critical", state="firing"}}'] = "1x5"
    series[
        "gpufleet_alert_active{"
        + first
        + ", "
        + ", ".join(f'{k}="{v}"' for k, v in zip(names, ("straggler", *late)))
        + "}"
    ] = "1x5"
    (by_kind,) = panel_exprs(dashboard, "Firing alerts by kind")
    (active,) = panel_exprs(dashboard, "Active alerts")
    rows = [("straggler", *both["straggler"]), ("thermal_throttle", *both["thermal_throttle"]), ("straggler", *late)]
    expected = [
        {
            "expr": by_kind,
            "eval_time": "2m",
            "exp_samples": [
                {"labels": '{kind="straggler"}', "value": 2},
                {"labels": '{kind="thermal_throttle"}', "value": 1},
            ],
        },
        {
            "expr": active,
            "eval_time": "2m",
            "exp_samples": [
                {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in zip(names, row) if v) + "}", "value": 1}
                for row in rows
            ],
        },
    ]
    promql_expr_tests(tmp_path, series, expected)


@requires_promtool
def test_gpu_hours_lost_counts_each_job_and_cause_once_over_an_ha_pair(dashboard: dict, tmp_path) -> None:
    """Both replicas count the same loss: the panel shows it once per job and cause, not summed."""
    series = {}
    for replica in ("srv-0:9472", "srv-1:9472"):
        server = f'job="gpufleet-server", instance="{replica}"'
        series[f'gpufleet_job_gpu_seconds_lost_total{{{server}, hpc_job="71001", kind="straggler"}}'] = "0+3600x120"
        series[f'gpufleet_job_gpu_seconds_lost_total{{{server}, hpc_job="71001", kind="comm_bound"}}'] = "0+7200x120"
    (lost,) = panel_exprs(dashboard, "GPU-hours lost in the time range, by job and cause")
    expected = [
        {
            "expr": lost,
            "eval_time": "120m",
            "exp_samples": [
                {"labels": '{hpc_job="71001", kind="comm_bound"}', "value": 120},
                {"labels": '{hpc_job="71001", kind="straggler"}', "value": 60},
            ],
        }
    ]
    promql_expr_tests(tmp_path, series, expected)


DCGM_RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "dcgm-recording-rules.yaml"
DCGM_HOSTS = {"node-a": "71001", "node-b": "71002"}
DCGM_GPUS = 4
# Panels with data from dcgm-exporter's stock counters through the recording rules: (query index, range).
DCGM_ALWAYS = {
    "Utilization per GPU": (0, (0.0, 1.0)),
    "Power per GPU": (0, (10.0, 800.0)),
    "SM clock per GPU": (0, (1e8, 3e9)),
    "Temperature": (0, (20.0, 100.0)),
    "HBM temperature": (0, (20.0, 110.0)),
}
# Panels (and query index) that need a reading the stock counters lack, and the DCGM field each names.
DCGM_LACKING = {
    "SM activity per GPU": (0, "DCGM_FI_PROF_SM_ACTIVE"),
    "Temperature": (1, "DCGM_FI_DEV_SLOWDOWN_TEMP"),
    "HBM temperature": (1, "DCGM_FI_DEV_MEM_MAX_OP_TEMP"),
    "Throttle reasons active (idle excluded)": (0, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
}


@contextlib.contextmanager
def dcgm_exporter_endpoint(fleet) -> Iterator[int]:
    """A loopback HTTP endpoint serving each host's dcgm-exporter text at /HOST/metrics; yields its port."""
    last: dict[str, float] = {}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            host = self.path.strip("/").split("/")[0]
            if host not in fleet.hosts:
                self.send_error(404)
                return
            with lock:
                now = time.time()
                body = fleet.scrape(now, now - last.get(host, now - 1.0), host).encode()
                last[host] = now
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@requires_prometheus
@requires_promtool
def test_the_panels_work_on_dcgm_exporter_data_through_the_recording_rules(dashboard: dict, tmp_path) -> None:
    """No gpufleet agent: a real Prometheus scraping dcgm-exporter's stock counters and evaluating
    deploy/prometheus/dcgm-recording-rules.yaml shows the GPU panels whose readings dcgm-exporter has, and
    each panel that needs one it lacks says which."""
    checked = subprocess.run([PROMTOOL, "check", "rules", str(DCGM_RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    fleet = Fleet(
        DCGM_HOSTS, DCGM_GPUS, lambda t, host, gpu: Gpu(temperature_celsius=60.0 + gpu, power_watts=600.0 + 10 * gpu)
    )
    gpus = len(DCGM_HOSTS) * DCGM_GPUS
    with dcgm_exporter_endpoint(fleet) as port:
        jobs = "".join(
            f"  - job_name: dcgm-exporter-{host}\n    metrics_path: /{host}/metrics\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
            for host in DCGM_HOSTS
        )
        with prometheus_process(tmp_path, [], jobs, rule_files=[DCGM_RULES]) as (prom, prom_port, log_path):
            api = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}/api/v1", timeout=10)

            def query(expr: str) -> list[dict]:
                answer = api.get("/query", params={"query": expr}).json()
                assert answer["status"] == "success", (expr, answer)
                return answer["data"]["result"]

            waiter = threading.Event()
            counted = 0
            for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
                assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
                counted = len(query("count_over_time(gpufleet_gpu_energy_joules_total[10s]) >= 3"))
                if counted == gpus:
                    break
                waiter.wait(POLL_SECONDS)
            else:
                pytest.fail(f"the recording rules never made three points of every GPU ({counted} of {gpus})")

            for variable in dashboard["templating"]["list"]:
                if variable["type"] == "query":
                    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
                    values = api.get(f"/label/{label}/values", params={"match[]": metric}).json()["data"]
                    assert values == {"node": sorted(DCGM_HOSTS), "hpc_job": sorted(DCGM_HOSTS.values())}[label]
            results = {}
            for panel in panels(dashboard):
                for i, target in enumerate(panel.get("targets", [])):
                    results[(panel["title"], i)] = query(grafana(target["expr"]))

    for title, (i, (low, high)) in DCGM_ALWAYS.items():
        result = results[(title, i)]
        keys = {(s["metric"]["node"], s["metric"]["gpu"]) for s in result}
        assert len(keys) == len(result) == gpus, (title, [s["metric"] for s in result])
        for series in result:
            assert low <= float(series["value"][1]) <= high, (title, series)
    util = results[("Utilization per GPU", 0)]
    assert {s["metric"]["hpc_job"] for s in util} == set(DCGM_HOSTS.values())
    assert all(float(s["value"][1]) == pytest.approx(0.98) for s in util)  # 98 % -> 0.98
    clocks = results[("SM clock per GPU", 0)]
    assert all(float(s["value"][1]) == pytest.approx(1.98e9) for s in clocks)  # 1980 MHz -> Hz
    for title, (i, field) in DCGM_LACKING.items():
        assert results[(title, i)] == [], title
        (panel,) = [p for p in panels(dashboard) if p.get("title") == title]
        assert field in panel.get("description", ""), title
