"""A real Prometheus scrapes a real agent (simulated H100 node) and the series arrive in its query API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.agent.running import agent_process

PROMETHEUS = shutil.which("prometheus")
DEADLINE_SECONDS = 30.0
POLL_SECONDS = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)["data"]["result"]
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return []  # Prometheus still starting


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed (apt-get install prometheus)")
def test_prometheus_scrapes_the_agent(tmp_path):
    with agent_process("--simulate", "hgx-h100", "--node", "hgx-h100-01") as (agent, agent_port):
        prom_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: gpufleet-agent\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{agent_port}']}}]\n"
        )
        log_path = tmp_path / "prometheus.log"
        log_file = log_path.open("wb")
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log_file,
        )
        try:
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
        finally:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
            log_file.close()
