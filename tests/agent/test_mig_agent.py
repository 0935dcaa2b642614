"""`gpufleet-agent --simulate mig` as a real process: its /metrics has the per-instance and per-process
families, each documented in docs/agent.md's metrics table, promtool clean; its dcgm form labels instances
as dcgm-exporter does."""

from __future__ import annotations

import subprocess

import httpx

from tests.agent.running import PROMTOOL, ROOT, agent_process
from tests.test_metrics_documented import documented, scrape_until, served

MIG_FAMILIES = {
    "gpufleet_gpu_mig_enabled",
    "gpufleet_mig_memory_used_bytes",
    "gpufleet_mig_memory_total_bytes",
    "gpufleet_mig_sm_active_ratio",
    "gpufleet_mig_sm_occupancy_ratio",
    "gpufleet_gpu_process_memory_used_bytes",
}


def test_a_mig_node_serves_documented_per_instance_and_per_process_families():
    with agent_process("--simulate", "mig", "--sample.interval", "0.5") as (_, port):
        text = scrape_until(f"http://127.0.0.1:{port}/metrics", lambda t: "gpufleet_mig_sm_active_ratio{" in t)
        snapshot = httpx.get(f"http://127.0.0.1:{port}/snapshot", timeout=5).json()
    assert MIG_FAMILIES <= served(text)
    assert served(text) - documented(ROOT / "docs" / "agent.md") == set()
    assert 'profile="1g.10gb"' in text and 'process="python3"' in text
    assert [len(g["mig_instances"]) for g in snapshot["gpus"]] == [3, 7, 0, 0]
    if PROMTOOL is not None:  # lint included; where promtool is missing, tests/agent/test_promtool.py says so
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_a_mig_node_in_dcgm_names_has_gpu_i_id_and_gpu_i_profile():
    with agent_process("--simulate", "mig", "--sample.interval", "0.5", "--metrics.names", "dcgm") as (_, port):
        text = scrape_until(f"http://127.0.0.1:{port}/metrics", lambda t: "DCGM_FI_DEV_FB_USED{" in t)
    lines = [ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_FB_USED{")]
    assert sum('GPU_I_ID="' in ln and 'GPU_I_PROFILE="' in ln for ln in lines) == 10
    assert any('GPU_I_PROFILE="3g.40gb"' in ln and 'gpu="0"' in ln for ln in lines)
