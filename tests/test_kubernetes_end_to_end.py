"""A Kubernetes job beside a Slurm job, end to end: simulated NVML -> agent sampler and job attribution
over the simulator's procfs -> --record lines -> replay engine -> alerts.

The Kubernetes job's pods carry GPUFLEET_JOB=NAMESPACE/NAME (docs/agent.md asks the pod template to set it
from the job's label), and the rendezvous its operator gives every pod (MASTER_ADDR, MASTER_PORT); a pod
is only one node's share of the job. The test checks that the agent's default attribution turns either
into one job across both nodes, so the engine compares the two pods' GPUs as peers and names the slow
GPU, with the job, as for a Slurm job; and that the job-wide communication slowdown, which only a known
job can show, is seen at all.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gpufleet.agent.sim import Scenario, parse_scenario
from gpufleet.server.alerts import Alert
from gpufleet.server.contract import parse_line
from gpufleet.server.replay import run_replay
from bench.evaluation.sim_record import T0, record_cluster

K8S_JOB = "research/llama-70b"
# The same job without GPUFLEET_JOB: the operator's MASTER_ADDR, completed with the pods' namespace.
K8S_RENDEZVOUS = "llama-70b-worker-0.research.svc.cluster.local:29500"
SLURM_JOB = "71003"

# The demo's timetable (agent/sim/scenarios/demo.yaml explains it): ramp-up and baselines first, the
# slow GPU from +220 s to +360 s, the job's network slowed from +480 s to +600 s, then time to resolve.
SCENARIO = {
    "name": "k8s-and-slurm",
    "duration_s": 720,
    "nodes": [{"name": n, "model": "h100-sxm", "gpus": 8} for n in ("gpu-a", "gpu-b", "gpu-c")],
    "jobs": [
        {
            "id": K8S_JOB,
            "scheduler": "kubernetes",
            "nodes": ["gpu-a", "gpu-b"],
            "step_time_s": 0.8,
            "compute_fraction": 0.8,
            "memory_used_gib": 64,
        },
        {"id": SLURM_JOB, "nodes": ["gpu-c"], "step_time_s": 1.0, "compute_fraction": 0.75, "memory_used_gib": 58},
    ],
    "incidents": [
        {
            "kind": "slow_gpu",
            "node": "gpu-b",
            "gpu": 5,
            "start_s": 220,
            "end_s": 360,
            "speed_factor": 0.7,
            "silent": True,
        },
        {"kind": "comm_slowdown", "job": K8S_JOB, "start_s": 480, "end_s": 600, "factor": 3.0},
    ],
}


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return parse_scenario(SCENARIO)


@pytest.fixture(scope="module")
def trace(scenario: Scenario, tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    return record_cluster(scenario, tmp_path_factory.mktemp("k8s"), float(SCENARIO["duration_s"]))


@pytest.fixture(scope="module")
def alerts(trace: list[bytes]) -> list[Alert]:
    return run_replay(trace)


def test_every_gpu_carries_its_job_whichever_scheduler_started_it(trace: list[bytes]) -> None:
    jobs: dict[str, set[str | None]] = {}
    for line in trace:
        sample = parse_line(line)
        jobs.setdefault(sample.node, set()).update(sample.jobs)
    assert jobs == {"gpu-a": {K8S_JOB}, "gpu-b": {K8S_JOB}, "gpu-c": {SLURM_JOB}}


def test_the_kubernetes_jobs_incidents_are_named_with_the_job(alerts: list[Alert]) -> None:
    described = [(a.kind.value, a.node, a.gpu, a.hpc_job) for a in alerts]
    assert described == [("straggler", "gpu-b", 5, K8S_JOB), ("comm_bound", None, None, K8S_JOB)], described
    for alert, (start_s, end_s) in zip(alerts, ((220, 360), (480, 600))):
        started = alert.started - T0
        assert start_s <= started <= end_s, f"{alert.kind.value} fired at +{started:.0f}s, outside its incident"
        assert alert.resolved is not None and alert.resolved - T0 > end_s


def test_without_the_variable_the_job_is_its_rendezvous_and_its_incidents_are_named_with_it(
    scenario: Scenario, tmp_path: Path
) -> None:
    trace = record_cluster(scenario, tmp_path, float(SCENARIO["duration_s"]), env_vars=("SLURM_JOB_ID",))
    pods: dict[str, set] = {}
    for line in trace:
        snapshot = orjson.loads(line)
        pods.setdefault(snapshot["node"], set()).update(
            (g["hpc_job"], g["kubernetes_namespace"], g["kubernetes_pod"]) for g in snapshot["gpus"]
        )
    assert pods == {
        "gpu-a": {(K8S_RENDEZVOUS, "research", "llama-70b-worker-0")},
        "gpu-b": {(K8S_RENDEZVOUS, "research", "llama-70b-worker-1")},
        "gpu-c": {(SLURM_JOB, None, None)},
    }
    described = [(a.kind.value, a.node, a.gpu, a.hpc_job) for a in run_replay(trace)]
    assert described == [("straggler", "gpu-b", 5, K8S_RENDEZVOUS), ("comm_bound", None, None, K8S_RENDEZVOUS)]
