"""A real Prometheus scrapes a real agent (simulated H100 node) and the series arrive in its query API."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request

import bcrypt

from tests.agent.running import agent_process, prometheus_process, requires_prometheus
from tests.tlsfiles import make_pki, needs_openssl

DEADLINE_SECONDS = 30.0
POLL_SECONDS = 0.25


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)["data"]["result"]
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return []  # Prometheus still starting


@requires_prometheus
def test_prometheus_scrapes_the_agent(tmp_path):
    with (
        agent_process("--simulate", "hgx-h100", "--node", "hgx-h100-01") as (agent, agent_port),
        prometheus_process(tmp_path, [agent_port]) as (prom, prom_port, log_path),
    ):
        result: list[dict] = []
        waiter = threading.Event()
        for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
            assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
            result = query(prom_port, 'gpufleet_gpu_utilization_ratio{job="gpufleet-agent"}')
            if len(result) == 8:
                break
            waiter.wait(POLL_SECONDS)
        assert sorted(int(r["metric"]["gpu"]) for r in result) == list(range(8))
        assert {r["metric"]["node"] for r in result} == {"hgx-h100-01"}
        assert all(0.0 <= float(r["value"][1]) <= 1.0 for r in result)
        up = query(prom_port, 'up{job="gpufleet-agent"}')
        assert up and up[0]["value"][1] == "1"
        assert query(prom_port, "gpufleet_agent_nvml_up")[0]["value"][1] == "1"


@requires_prometheus
@needs_openssl
def test_prometheus_scrapes_an_agent_behind_mutual_tls_and_basic_auth(tmp_path):
    """The exporter-toolkit file a fleet already has, read by our agent, scraped by Prometheus's own client."""
    pki = make_pki(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
        f"basic_auth_users:\n  prometheus: '{bcrypt.hashpw(b's3cret', bcrypt.gensalt(4)).decode()}'\n"
    )
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    scrape = (
        f"    scheme: https\n"
        f"    tls_config: {{ca_file: '{pki.ca_cert}', cert_file: '{pki.client_cert}', key_file: '{pki.client_key}'}}\n"
        f"    basic_auth: {{username: prometheus, password_file: '{secret}'}}\n"
    )
    with (
        agent_process("--simulate", "hgx-h100", "--node", "hgx-h100-01", "--web.config.file", str(web)) as (
            _,
            agent_port,
        ),
        prometheus_process(tmp_path, [agent_port], scrape) as (prom, prom_port, log_path),
    ):
        up: list[dict] = []
        waiter = threading.Event()
        for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
            assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
            up = query(prom_port, 'up{job="gpufleet-agent"}')
            if up and up[0]["value"][1] == "1":
                break
            waiter.wait(POLL_SECONDS)
        assert up and up[0]["value"][1] == "1", log_path.read_text(errors="replace")[-2000:]
        assert len(query(prom_port, 'gpufleet_gpu_utilization_ratio{job="gpufleet-agent"}')) == 8
