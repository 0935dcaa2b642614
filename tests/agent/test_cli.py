"""The CLI end to end on the simulator: --once against the snapshot contract, --record, serving, SIGTERM."""

from __future__ import annotations

import ctypes.util
import gc
import http.client
import math
import os
import signal
import sys
import threading

import orjson
import pytest

from gpufleet.agent.cli import main
from tests.agent.running import agent_process

# The snapshot contract (schema 1) of issue 2: GPU fields and the JSON types each may take.
NUM = (int, float)
GPU_FIELDS = {
    "index": int,
    "uuid": str,
    "model": str,
    "hpc_job": (str, type(None)),
    "up": bool,
    "utilization_ratio": NUM,
    "sm_active_ratio": NUM,
    "memory_used_bytes": int,
    "memory_total_bytes": int,
    "temperature_celsius": NUM,
    "memory_temperature_celsius": NUM,
    "slowdown_temperature_celsius": NUM,
    "power_watts": NUM,
    "power_limit_watts": NUM,
    "energy_joules_total": NUM,
    "sm_clock_hertz": NUM,
    "sm_clock_max_hertz": NUM,
    "throttle_reasons": int,
    "nvlink_tx_bytes_total": int,
    "nvlink_rx_bytes_total": int,
    "pcie_tx_bytes_total": int,
    "pcie_rx_bytes_total": int,
    "xid_errors_total": int,
}


# main() points the root logger at stderr with its own level (see conftest.py).
pytestmark = pytest.mark.usefixtures("restore_logging")


def once(capsys, *args: str) -> dict:
    assert main(["--once", "--log.level", "error", *args]) == 0
    return orjson.loads(capsys.readouterr().out)


def check_contract(doc: dict) -> None:
    assert doc["schema"] == 1 and isinstance(doc["node"], str) and doc["node"]
    assert isinstance(doc["time"], float) and doc["time"] > 1.6e9
    for gpu in doc["gpus"]:
        for name, kind in GPU_FIELDS.items():
            assert name in gpu, name
            value = gpu[name]
            assert value is None or isinstance(value, kind), (name, value)
            if isinstance(value, float):
                assert math.isfinite(value), name
        for name, value in gpu.items():
            if name.endswith("_ratio") and value is not None:
                assert 0.0 <= value <= 1.0, (name, value)


def test_once_on_simulated_h100_matches_the_contract(capsys):
    doc = once(capsys, "--simulate", "hgx-h100")
    check_contract(doc)
    assert len(doc["gpus"]) == 8 and [g["index"] for g in doc["gpus"]] == list(range(8))
    gpu = doc["gpus"][0]
    assert gpu["up"] and gpu["model"].startswith("NVIDIA H100")
    # Two samples an interval apart: GPM SM activity has a value.
    assert all(g["sm_active_ratio"] is not None for g in doc["gpus"])
    # Attribution ran through the simulator's materialized procfs.
    assert all(g["hpc_job"] for g in doc["gpus"])
    assert doc["gpus"][0]["nvlink_link_tx_bytes_total"] == []


def test_once_without_gpm_leaves_sm_activity_null(capsys):
    doc = once(capsys, "--simulate", "a100")
    check_contract(doc)
    assert doc["gpus"] and all(g["sm_active_ratio"] is None for g in doc["gpus"])
    assert all(g["utilization_ratio"] is not None for g in doc["gpus"])


def test_once_per_link_nvlink(capsys):
    doc = once(capsys, "--simulate", "hgx-h100", "--nvlink.per-link")
    links = doc["gpus"][0]["nvlink_link_tx_bytes_total"]
    assert len(links) == 18 and all(isinstance(v, int) for v in links)


def test_once_with_record_appends_a_line(capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    doc = once(capsys, "--simulate", "pcie", "--record", str(path))
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1 and orjson.loads(lines[0]) == doc


def test_mapping_dir_overrides_simulated_procfs(capsys, tmp_path):
    (tmp_path / "0").write_text("123\n")
    doc = once(capsys, "--simulate", "hgx-h100", "--hpc-job-mapping-dir", str(tmp_path))
    assert doc["gpus"][0]["hpc_job"] == "123" and doc["gpus"][1]["hpc_job"] is None


def test_a_kubernetes_job_is_named_by_the_variables_the_agent_is_told_to_read(capsys, tmp_path):
    scenario = tmp_path / "k8s.yaml"
    scenario.write_text(
        "nodes: [{name: n1, model: h100-sxm, gpus: 2}]\n"
        "jobs: [{id: research/llama, nodes: [n1], scheduler: kubernetes}]\n"
    )
    doc = once(capsys, "--simulate", str(scenario))
    assert [g["hpc_job"] for g in doc["gpus"]] == ["research/llama"] * 2
    assert [(g["kubernetes_namespace"], g["kubernetes_pod"]) for g in doc["gpus"]] == [
        ("research", "llama-worker-0")
    ] * 2
    # Without the variable, the job's rendezvous (the operator's MASTER_ADDR, in the pod's namespace) names it.
    doc = once(capsys, "--simulate", str(scenario), "--hpc-job-env-vars", "SLURM_JOB_ID")
    assert [g["hpc_job"] for g in doc["gpus"]] == ["llama-worker-0.research.svc.cluster.local:29500"] * 2
    doc = once(
        capsys, "--simulate", str(scenario), "--hpc-job-env-vars", "SLURM_JOB_ID", "--hpc-job-rendezvous", "false"
    )
    assert [g["hpc_job"] for g in doc["gpus"]] == [None, None]


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--simulate", "no-such-scenario"], "--simulate"),
        (["--simulate", "hgx-h100", "--node", "elsewhere"], "--node"),
    ],
)
def test_bad_simulation_arguments_exit_2(capsys, args, fragment):
    assert main(["--once", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpufleet-agent: error: {fragment}") and err.count("\n") == 1


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_serves_survives_sighup_and_a_rotation_and_exits_0_on_sigterm(tmp_path):
    trace, rotated = tmp_path / "trace.jsonl", tmp_path / "trace.jsonl.1"
    with agent_process("--simulate", "hgx-h100", "--sample.interval", "0.2", "--record", str(trace)) as (proc, port):
        waiter = threading.Event()
        deadline = 150  # 150 x 0.1 s at most: the first sample lands within one interval
        while get(port, "/healthz")[0] != 200 and deadline:
            waiter.wait(0.1)
            deadline -= 1
        status, body = get(port, "/metrics")
        assert status == 200 and body.count(b"gpufleet_gpu_utilization_ratio{") == 8

        # logrotate: move the file away, then SIGHUP (which would end a process that does not handle it).
        trace.rename(rotated)
        proc.send_signal(signal.SIGHUP)
        deadline = 150
        while not trace.exists() and proc.poll() is None and deadline:
            waiter.wait(0.1)
            deadline -= 1
        assert proc.poll() is None and get(port, "/healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    for path in (rotated, trace):
        lines = path.read_bytes().splitlines()
        assert lines and all(orjson.loads(line)["schema"] == 1 for line in lines)


NO_DRIVER = ctypes.util.find_library("nvidia-ml") is None
needs_no_driver = pytest.mark.skipif(not NO_DRIVER, reason="an NVIDIA driver is installed: NVML would open")


@needs_no_driver
def test_once_without_a_driver_exits_1_with_the_reason(capsys):
    assert main(["--once", "--log.level", "error"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpufleet-agent: error: no sample: nvmlInit failed") and err.count("\n") == 1


@needs_no_driver
def test_serving_without_a_driver_answers_with_health_only():
    with agent_process() as (proc, port):
        waiter = threading.Event()
        status, body = get(port, "/metrics")
        for _ in range(600):  # the first cycle publishes within moments of startup (60 s: a loaded CI box)
            if status == 200:
                break
            waiter.wait(0.1)
            status, body = get(port, "/metrics")
        assert status == 200 and b"gpufleet_agent_nvml_up{" in body and b"} 0.0" in body
        assert b"gpufleet_gpu_" not in body
        status, health = get(port, "/healthz")
        assert status == 503 and orjson.loads(health)["status"] == "nvml_down"
        assert proc.poll() is None  # still running, retrying with backoff


def test_the_agent_serves_with_the_gil_handed_over_quickly_and_start_up_frozen(monkeypatch):
    """A full collection of what start-up built holds the GIL for milliseconds, and Python's 5 ms switch
    interval would keep a scrape waiting behind a sampling cycle as long: both are set before sampling."""
    from gpufleet.agent.cli import SWITCH_INTERVAL_SECONDS
    from gpufleet.agent.sampler import Sampler

    seen = {}

    def start(self):
        seen.update(interval=sys.getswitchinterval(), frozen=gc.get_freeze_count())
        os.kill(os.getpid(), signal.SIGTERM)  # the agent's own handler stops it

    monkeypatch.setattr(Sampler, "start", start)
    interval = sys.getswitchinterval()
    try:
        assert main(["--simulate", "hgx-h100", "--web.listen-address", "127.0.0.1:0", "--log.level", "error"]) == 0
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)
    assert seen["interval"] == pytest.approx(SWITCH_INTERVAL_SECONDS) and SWITCH_INTERVAL_SECONDS <= 0.0001
    assert seen["frozen"] > 1000  # the modules, configuration and simulator start-up made
