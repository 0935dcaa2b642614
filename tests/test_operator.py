"""The Prometheus Operator manifests (deploy/kubernetes/operator/): well-formed, selecting what the other
manifests deploy, generated files in step with their sources, the rules accepted by promtool, and an
operator-style scrape of a real agent keeping the training pod's kube-state-metrics join."""

from __future__ import annotations

import contextlib
import http.server
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from tests.agent.running import (
    PROMETHEUS,
    PROMTOOL,
    _daemon,
    agent_process,
    free_port,
    requires_prometheus,
    requires_promtool,
)

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "deploy" / "kubernetes" / "operator"
DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.5


def _docs(folder: Path) -> list[dict]:
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _one(kind: str, folder: Path = OPERATOR) -> dict:
    (doc,) = [d for d in _docs(folder) if d["kind"] == kind]
    return doc


def _render() -> object:
    spec = __import__("importlib.util").util.spec_from_file_location("render", OPERATOR / "render.py")
    module = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_operator_manifest_has_the_fields_its_custom_resource_requires():
    kinds = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"}
    docs = _docs(OPERATOR)
    assert sorted(d["kind"] for d in docs) == sorted(kinds)
    for doc in docs:
        expected = "v1" if doc["kind"] == "ConfigMap" else "monitoring.coreos.com/v1"
        assert doc["apiVersion"] == expected, doc["kind"]
        assert doc["metadata"]["name"] and doc["metadata"]["namespace"] == "monitoring", doc["kind"]
        assert all(isinstance(v, str) for v in doc["metadata"]["labels"].values()), doc["kind"]
    assert _one("ConfigMap")["metadata"]["labels"]["grafana_dashboard"] == "1"
    for group in _one("PrometheusRule")["spec"]["groups"]:
        assert group["name"] and all(("alert" in r) != ("record" in r) and r["expr"] for r in group["rules"])


def test_the_monitors_select_the_pods_and_ports_the_other_manifests_deploy():
    kube = _docs(ROOT / "deploy" / "kubernetes")
    (daemonset,) = [d for d in kube if d["kind"] == "DaemonSet"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    monitor = _one("PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    # Without it the agent's namespace/pod labels become exported_namespace/exported_pod (see the test below).
    assert endpoint["honorLabels"] is True

    (service,) = [d for d in kube if d["kind"] == "Service" and d["metadata"]["name"] == "gpufleet-server"]
    monitor = _one("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_the_generated_manifests_are_in_step_with_the_rules_file_and_the_dashboard():
    render = _render()
    for name, make in render.OUTPUTS.items():
        assert (OPERATOR / name).read_text() == make(), f"{name} is out of date: run `make operator-manifests`"
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "gpufleet-rules.yaml").read_text())["groups"]
    assert _one("PrometheusRule")["spec"]["groups"] == rules


@requires_promtool
def test_promtool_accepts_the_rules_inside_the_prometheusrule(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": _one("PrometheusRule")["spec"]["groups"]}))
    done = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# One Kubernetes pod of a training job on the node; the agent reads its namespace and pod name.
SCENARIO = """
name: k8s-one
duration_s: 3600
nodes: [{name: gpu-a, model: h100-sxm, gpus: 2}]
jobs:
  - {id: research/llama-70b, scheduler: kubernetes, nodes: [gpu-a], step_time_s: 0.8, compute_fraction: 0.8,
     memory_used_gib: 64}
"""
# kube-state-metrics as it would answer: the training pod, and the agent's own pod, with different teams.
KUBE_STATE = (
    b'kube_pod_labels{namespace="research",pod="llama-70b-worker-0",label_team="nlp"} 1\n'
    b'kube_pod_labels{namespace="monitoring",pod="gpufleet-agent-x7k2p",label_team="observability"} 1\n'
)


@contextlib.contextmanager
def _kube_state_metrics() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(KUBE_STATE)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _operator_scrape(monitor: dict, port: int) -> dict:
    """The scrape config the operator generates from a PodMonitor's endpoint, with the target labels its
    relabelling gives a pod of the DaemonSet (namespace, pod, container of the agent's own pod)."""
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    meta = monitor["metadata"]
    return {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
        "honor_labels": endpoint.get("honorLabels", False),
        "metrics_path": endpoint["path"],
        "static_configs": [
            {
                "targets": [f"127.0.0.1:{port}"],
                "labels": {
                    "namespace": "monitoring",
                    "pod": "gpufleet-agent-x7k2p",
                    "container": "agent",
                    "endpoint": endpoint["port"],
                },
            }
        ],
    }


@requires_prometheus
def test_an_operator_style_scrape_keeps_the_training_pods_join_with_kube_state_metrics(tmp_path):
    scenario = tmp_path / "k8s.yaml"
    scenario.write_text(SCENARIO)
    with agent_process("--simulate", str(scenario)) as (_, agent_port), _kube_state_metrics() as ksm_port:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                _operator_scrape(_one("PodMonitor"), agent_port),
                {
                    "job_name": "kube-state-metrics",
                    "honor_labels": True,
                    "static_configs": [{"targets": [f"127.0.0.1:{ksm_port}"]}],
                },
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        with _daemon(cmd, port, tmp_path / "prometheus.log", "http", None) as (prom, log_path):
            api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10)
            join = "gpufleet_gpu_pod_info * on(namespace, pod) group_left(label_team) kube_pod_labels"
            waiter = threading.Event()
            result: list = []
            for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
                assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
                result = api.get("/query", params={"query": join}).json()["data"]["result"]
                if result:
                    break
                waiter.wait(POLL_SECONDS)
            else:
                pytest.fail(
                    "the join never matched: "
                    + str(api.get("/query", params={"query": "gpufleet_gpu_pod_info"}).json()["data"]["result"])
                )
            assert sorted(r["metric"]["gpu"] for r in result) == ["0", "1"]
            assert {(r["metric"]["namespace"], r["metric"]["pod"], r["metric"]["label_team"]) for r in result} == {
                ("research", "llama-70b-worker-0", "nlp")
            }
            # Series without pod labels of their own keep the agent pod's target labels.
            own = api.get("/query", params={"query": "gpufleet_agent_nvml_up"}).json()["data"]["result"]
            assert own and own[0]["metric"]["pod"] == "gpufleet-agent-x7k2p"
            renamed = api.get("/query", params={"query": '{__name__=~"gpufleet_.+", exported_pod!=""}'}).json()
            assert renamed["data"]["result"] == []
