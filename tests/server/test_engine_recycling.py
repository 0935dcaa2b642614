"""A server up for weeks sees thousands of jobs come and go. The id of a group gone for
group_retention_seconds goes to the next new group: the engine stays as large as the live jobs need,
and a job given a recycled id is judged as itself, never by what was learned about the job before it."""

from __future__ import annotations

import math

import numpy as np

from gpufleet.server.alerts import AlertKind
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig
from gpufleet.server.engine.detectors import FingerprintIndex, subject_fingerprint
from gpufleet.server.engine.groups import JOB
from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines

RETENTION_S = 900.0


def _a_then_b(t, node, gpu):
    """Job a (a heavier workload: higher SM activity and power) until 600 s, idle GPUs until 1600 s, then
    job b on the same GPUs: node n1 starved by its host 2300-2700 s, a communication slowdown 3100-3400 s."""
    if t < 600:
        return {"hpc_job": "a", "sm_active_ratio": 0.95, "power_watts": 650.0}
    if t < 1600:
        return {"hpc_job": None, "utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}
    kw: dict = {"hpc_job": "b"}
    if 2300 <= t < 2700:
        kw.update(
            {"utilization_ratio": 0.70, "sm_active_ratio": 0.55, "power_watts": 380.0}
            if node == "n1"
            else {"sm_active_ratio": 0.60, "power_watts": 400.0}
        )
    if 3100 <= t < 3400:
        kw.update(sm_active_ratio=0.55, power_watts=400.0)
    return kw


def _summary(alerts):
    return [(a.kind.value, a.hpc_job, a.node, a.gpu, a.started, a.resolved) for a in alerts]


def test_a_job_given_a_recycled_id_is_judged_as_itself():
    lines = cluster_lines(3700, nodes=3, override=_a_then_b)
    engine = Engine(EngineConfig(group_retention_seconds=RETENTION_S))
    a_id = None
    for line in lines:
        sample = parse_line(line)
        engine.ingest(sample)
        engine.advance(sample.time)
        a_id = engine.registry.ids.get((JOB, "a"), a_id)
    assert engine.registry.ids[(JOB, "b")] == a_id  # b took a's id

    recycled = run_replay(lines, {"group_retention_seconds": RETENTION_S})
    fresh = run_replay(lines, EngineConfig(group_retention_seconds=math.inf))
    assert _summary(recycled) == _summary(fresh)
    straggler, comm = recycled
    assert (straggler.kind.value, straggler.hpc_job, straggler.node, straggler.gpu) == ("straggler", "b", "n1", None)
    assert T0 + 2300 < straggler.started <= T0 + 2380 and straggler.resolved is not None
    assert (comm.kind.value, comm.hpc_job) == ("comm_bound", "b")
    assert T0 + 3100 < comm.started <= T0 + 3170 and comm.resolved is not None


def _one_gpu_jobs(t, node, gpu):
    """Every GPU runs a one-GPU job, a new one every 150 s."""
    return {"hpc_job": f"{int(t // 150)}-{node}-{gpu}"}


def test_groups_stay_as_many_as_the_jobs_of_the_retention_need():
    lines = cluster_lines(5400, nodes=1, override=_one_gpu_jobs)
    sizes = {}
    for retention in (RETENTION_S, math.inf):
        engine = Engine(EngineConfig(group_retention_seconds=retention))
        for line in lines:
            sample = parse_line(line)
            engine.ingest(sample)
            engine.advance(sample.time)
        sizes[retention] = len(engine.registry.keys)
        assert engine.history.values.shape[1] <= sizes[retention]
    assert sizes[math.inf] == 8 * 36  # every job ever seen
    assert sizes[RETENTION_S] <= 8 * (RETENTION_S / 150 + 2)  # those of the last retention


class _Windows:
    """What FingerprintIndex reads of the windows: each slot's node, GPU index and job."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slot_node = ["n0"] * n
        self.slot_index = list(range(n))
        self.slot_job = np.full(n, -1, dtype=np.int64)
        self.job_names: list[str] = []


def test_the_straggler_index_forgets_jobs_its_gpus_left_but_not_an_open_alert():
    w = _Windows(4)
    index = FingerprintIndex(AlertKind.STRAGGLER)
    fps = []
    for k in range(50):  # every GPU starts a new job, fifty times over
        w.job_names += [f"{k}-{s}" for s in range(4)]
        w.slot_job[:] = np.arange(4) + 4 * k
        fps.append(subject_fingerprint(AlertKind.STRAGGLER, "n0", 1, f"{k}-1"))
        assert index.get(w, fps[-1]) == (1, 4 * k + 1)
    still_open = fps[3]  # an alert about GPU 1's fourth job, not yet resolved
    index.prune({still_open}, EngineConfig().index_prune_ratio)
    assert index.get(w, still_open) == (1, 13)  # its clear test still finds the GPU (and the job moved on)
    assert index.get(w, fps[-1]) == (1, 197)  # the jobs the GPUs run now are kept
    assert index.get(w, fps[10]) is None
    assert len(index._map) == 5
