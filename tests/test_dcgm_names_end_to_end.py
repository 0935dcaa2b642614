"""A dcgm-exporter site's dashboard and alerts, unchanged, on `gpufleet-agent --metrics.names dcgm`.

A real Prometheus scrapes the agent on a simulated 8-GPU H100 node; the PromQL of Grafana dashboard 12239
(its variables and panels) and typical dcgm-exporter alert rules (tests/fixtures/dcgm-exporter) are
evaluated there. Each gives one series per GPU with dcgm-exporter's labels, or none where the agent does
not serve a field the query reads (agent.dcgm_names.FIELDS says which); a GPU's XID fires the XID rule
for that GPU alone. The server's Prometheus source reads the same Prometheus and rebuilds the node's
snapshots from these series, as it reads dcgm-exporter's.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx
import pytest
import yaml

from gpufleet.agent.dcgm_names import FIELDS, load_counters
from gpufleet.server.contract import parse_snapshot
from gpufleet.server.ingest.prometheus import PrometheusSource
from tests.agent.running import agent_process, prometheus_process, requires_prometheus

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm-exporter"
DASHBOARD = FIXTURES / "dashboard-12239.yaml"
RULES = FIXTURES / "alert-rules.yaml"
NODE = "hgx-h100-01"
GPUS = 8
DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.25
# Every GPU series dcgm-exporter writes carries these; hpc_job follows where a job holds the GPU.
DCGM_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"}
SERVED = {c.field for c in load_counters() if c.kind != "label" and FIELDS[c.field].reading}


def served(expr: str) -> bool:
    """Whether the agent's default set serves every DCGM field the expression reads."""
    return set(re.findall(r"DCGM_FI_\w+", expr)) <= SERVED


def signal(expr: str) -> str:
    """An alert's `SIGNAL OP THRESHOLD` less its comparison: what it watches, for every GPU."""
    match = re.fullmatch(r"(.+?)\s*(?:>|<|>=|<=|==|!=)\s*[0-9.]+", expr.strip())
    assert match, f"not SIGNAL OP THRESHOLD: {expr}"
    return match.group(1)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> Any:
    """The agent in dcgm form, a Prometheus scraping it with the alert rules loaded and a few scrapes
    stored; yields (Prometheus query API client, Prometheus base URL, the agent's snapshot)."""
    tmp = tmp_path_factory.mktemp("dcgm-names")
    with (
        agent_process("--simulate", "hgx-h100", "--node", NODE, "--metrics.names", "dcgm") as (_, agent_port),
        prometheus_process(tmp, [agent_port], rule_files=[RULES]) as (prom, port, log_path),
    ):
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10)
        until(
            "Prometheus holds three scrapes of every GPU and evaluated the rules",
            lambda: (
                len(_query(api, "count_over_time(DCGM_FI_DEV_GPU_TEMP[1m]) >= 3")) == GPUS
                and all(g.get("lastEvaluation", "0001").startswith("2") for g in _get(api, "/rules")["groups"])
            ),
            lambda: prom.poll() is None or pytest.fail(log_path.read_text(errors="replace")[-2000:]),
        )
        snapshot = httpx.get(f"http://127.0.0.1:{agent_port}/snapshot", timeout=10).json()
        yield api, f"http://127.0.0.1:{port}", snapshot


def until(what: str, check: Callable[[], bool], alive: Callable[[], object]) -> None:
    waiter = threading.Event()
    for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
        alive()
        try:
            if check():
                return
        except httpx.TransportError:
            pass  # Prometheus still opening
        waiter.wait(POLL_SECONDS)
    pytest.fail(f"never within {DEADLINE_SECONDS} s: {what}")


def _get(api: httpx.Client, path: str, **params: Any) -> Any:
    answer = api.get(path, params=params).json()
    assert answer["status"] == "success", answer
    return answer["data"]


def _query(api: httpx.Client, expr: str) -> list[dict]:
    return _get(api, "/query", query=expr)["result"]


def _dashboard() -> dict:
    return yaml.safe_load(DASHBOARD.read_text())


def _variables(api: httpx.Client) -> dict[str, list[str]]:
    """Each template variable's values, its query run as Grafana's label_values() runs it."""
    values: dict[str, list[str]] = {}
    for var in _dashboard()["variables"]:
        match = _substitute(var["metric"], values)
        values[var["name"]] = sorted(_get(api, f"/label/{var['label']}/values", **{"match[]": match}))
    return values


def _substitute(expr: str, values: Mapping[str, list[str]]) -> str:
    """A query with each $variable set to all its values, as Grafana's "All" writes them: (a|b|...)."""
    for name, vals in values.items():
        expr = expr.replace(f"${name}", "(" + "|".join(_regex_escaped(v) for v in vals) + ")")
    return expr


def _regex_escaped(value: str) -> str:
    """A label value as a literal inside a PromQL regex string, as Grafana escapes it (a backslash is
    doubled: one for the string, one for the regex)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


@requires_prometheus
def test_dashboard_12239_variables_list_the_node_and_its_gpus(scraped) -> None:
    api, _, _ = scraped
    assert _variables(api) == {"Hostname": [NODE], "gpu": sorted(str(i) for i in range(GPUS))}


@requires_prometheus
@pytest.mark.parametrize("panel", _dashboard()["panels"], ids=lambda p: p["title"])
def test_dashboard_12239_panel(scraped, panel: dict) -> None:
    api, _, snapshot = scraped
    result = _query(api, _substitute(panel["expr"], _variables(api)))
    if not served(panel["expr"]):
        # A field the agent does not read yet (docs/agent.md): no series, not zeros.
        assert result == [], panel["title"]
        return
    if not panel["per_gpu"]:
        assert len(result) == 1 and float(result[0]["value"][1]) > 0, result
        return
    assert sorted(int(r["metric"]["gpu"]) for r in result) == list(range(GPUS)), panel["title"]
    assert {r["metric"]["Hostname"] for r in result} == {NODE}
    if "UUID" in panel["expr"].rpartition("by")[2]:
        uuids = {str(g["index"]): g["uuid"] for g in snapshot["gpus"]}
        assert {r["metric"]["gpu"]: r["metric"]["UUID"] for r in result} == uuids


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@requires_prometheus
def test_every_default_counter_the_simulated_gpu_has_is_served_for_every_gpu(scraped) -> None:
    """dcgm-exporter's default set, less what a bare-metal H100 has not (the vGPU licence), one series a GPU."""
    api, _, _ = scraped
    listed = {c.field for c in load_counters() if c.kind != "label"}
    assert listed - SERVED == {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"}
    for field in sorted(SERVED):
        assert sorted(int(r["metric"]["gpu"]) for r in _query(api, field)) == list(range(GPUS)), field
    assert _query(api, "DCGM_FI_DEV_VGPU_LICENSE_STATUS") == []


@requires_prometheus
def test_alert_rules_load_and_evaluate(scraped) -> None:
    api, _, _ = scraped
    loaded = [rule for group in _get(api, "/rules")["groups"] for rule in group["rules"]]
    assert sorted(r["name"] for r in loaded) == sorted(r["alert"] for r in _rules())
    assert all(r["health"] == "ok" for r in loaded), [r for r in loaded if r["health"] != "ok"]
    # A healthy simulated node: nothing to page about (rules with a `for` cannot fire within a test).
    assert [a["labels"]["alertname"] for a in _get(api, "/alerts")["alerts"] if a["state"] == "firing"] == []


@requires_prometheus
@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_alert_rule_watches_every_gpu_with_dcgm_exporter_labels(scraped, rule: dict) -> None:
    api, _, snapshot = scraped
    watched = signal(rule["expr"])
    result = _query(api, watched)
    if not served(watched):
        assert result == [], rule["alert"]
        return
    gpus = {str(g["index"]): g for g in snapshot["gpus"]}
    if 'hpc_job!=""' in watched:
        gpus = {i: g for i, g in gpus.items() if g["hpc_job"]}
        assert gpus, "the scenario runs jobs"
    assert sorted(r["metric"]["gpu"] for r in result) == sorted(gpus), rule["alert"]
    for r in result:
        labels, gpu = r["metric"], gpus[r["metric"]["gpu"]]
        assert DCGM_LABELS <= set(labels), labels
        assert (labels["UUID"], labels["pci_bus_id"], labels["modelName"]) == (
            gpu["uuid"],
            gpu["pci_bus_id"],
            gpu["model"],
        )
        assert (labels["Hostname"], labels["device"]) == (NODE, f"nvidia{gpu['index']}")
        assert labels.get("hpc_job") == (gpu["hpc_job"] or None)


@requires_prometheus
def test_the_server_reads_the_dcgm_form_through_prometheus(scraped) -> None:
    """The server's Prometheus source, as deployed (schema auto), rebuilds the node from the DCGM series."""
    _, url, snapshot = scraped
    raws: list[dict] = []

    def parse(raw: Mapping[str, Any]) -> Any:
        raws.append(dict(raw))
        return parse_snapshot(raw)

    async def pull() -> Any:
        source = PrometheusSource(url, parse=parse, max_lookback_seconds=60)
        try:
            return await source.pull_once()
        finally:
            await source.aclose()

    result = asyncio.run(pull())
    assert result.samples and result.rejected_snapshots == 0
    newest = max(raws, key=lambda r: r["time"])
    assert newest["node"] == NODE
    rows = {g["uuid"]: g for g in newest["gpus"]}
    assert set(rows) == {g["uuid"] for g in snapshot["gpus"]}
    for g in snapshot["gpus"]:
        row = rows[g["uuid"]]
        assert (row["index"], row["model"], row["hpc_job"]) == (g["index"], g["model"], g["hpc_job"])
        # Read back in the contract's units from DCGM's (MHz, %, mJ): the same magnitudes the agent has.
        assert row["sm_clock_hertz"] == pytest.approx(g["sm_clock_hertz"], rel=0.05)
        assert 0.0 <= row["utilization_ratio"] <= 1.0
        assert row["temperature_celsius"] == pytest.approx(g["temperature_celsius"], abs=15)
        assert row["energy_joules_total"] > 0
        assert row["pcie_replays_total"] == g["pcie_replays_total"] == 0  # a health counter, read back


XID_SCENARIO = """
name: hgx-h100-xid
description: One 8x H100 node whose GPU 3 reports XID 79 five seconds in (after the agent listens for XIDs).
duration_s: 600
nodes:
  - {name: hgx-h100-01, model: h100-sxm, gpus: 8}
jobs:
  - {id: "70001", nodes: [hgx-h100-01], start_s: 0, step_time_s: 0.8, compute_fraction: 0.8}
incidents:
  - {kind: xid, node: hgx-h100-01, gpu: 3, start_s: 5, code: 79, count: 1}
"""


@requires_prometheus
def test_an_xid_fires_the_sites_alert_for_that_gpu_alone(tmp_path) -> None:
    scenario = tmp_path / "xid.yaml"
    scenario.write_text(XID_SCENARIO)
    with (
        agent_process("--simulate", str(scenario), "--metrics.names", "dcgm") as (_, agent_port),
        prometheus_process(tmp_path, [agent_port], rule_files=[RULES]) as (prom, port, log_path),
    ):
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10)
        until(
            "GpuXidError firing",
            lambda: bool(_query(api, 'ALERTS{alertname="GpuXidError", alertstate="firing"}')),
            lambda: prom.poll() is None or pytest.fail(log_path.read_text(errors="replace")[-2000:]),
        )
        (alert,) = _query(api, 'ALERTS{alertname="GpuXidError", alertstate="firing"}')
        snapshot = httpx.get(f"http://127.0.0.1:{agent_port}/snapshot", timeout=10).json()
        xids = {r["metric"]["gpu"]: float(r["value"][1]) for r in _query(api, "DCGM_FI_DEV_XID_ERRORS")}
    assert (alert["metric"]["gpu"], alert["metric"]["Hostname"]) == ("3", NODE)
    assert alert["metric"]["UUID"] == snapshot["gpus"][3]["uuid"]
    assert xids == {str(i): (79.0 if i == 3 else 0.0) for i in range(GPUS)}
