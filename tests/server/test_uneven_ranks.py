"""Uneven ranks in the suite's generator (tracegen Job.rank_work, Job.work_drift) and the engine on them:
a steadily different rank (a pipeline's last stage, an expert-heavy rank) is not a straggler; a real
straggler among uneven ranks still is."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import orjson
import pytest

from bench.evaluation import scenarios
from bench.evaluation.tracegen import ClusterSpec, Job, NodeSpec, generate


def _sm(trace) -> np.ndarray:
    """(samples, GPUs) SM activity of one node's lines, in GPU order."""
    rows = [orjson.loads(line) for line in trace.lines]
    rows = [r for r in rows if r["node"] == "n1"]
    return np.array([[g["sm_active_ratio"] for g in r["gpus"]] for r in sorted(rows, key=lambda r: r["time"])])


def _job(**kw) -> ClusterSpec:
    job = Job("j", "1", (("n1", tuple(range(8))),), startup_s=30.0, **kw)
    return ClusterSpec((NodeSpec("n1"),), (job,), (), 900.0, seed=4, order="time")


def test_a_busier_stage_computes_while_the_others_wait_all_along():
    trace = generate(_job(rank_work=(1.0,) * 6 + (1.15, 1.15)))
    sm = _sm(trace)[20:]
    # The last stage's ranks keep computing; the others spend the difference waiting, sample after sample.
    assert (sm[:, 6:].mean(axis=1) > sm[:, :6].mean(axis=1) * 1.08).mean() > 0.9
    assert not trace.truths


def test_drifting_work_moves_which_rank_is_busiest():
    trace = generate(replace(_job(work_drift=0.12), duration_s=1800.0))
    sm = _sm(trace)
    early, late = sm[20:60].mean(axis=0), sm[-60:-20].mean(axis=0)
    assert np.argsort(early).tolist() != np.argsort(late).tolist()
    assert not trace.truths


def test_even_jobs_keep_their_traces():
    spec = _job()
    assert generate(spec).lines == generate(replace(spec, jobs=(replace(spec.jobs[0], rank_work=()),))).lines


@pytest.mark.parametrize("name", [s.name for s in scenarios.UNEVEN])
def test_uneven_scenarios_say_what_they_hold(name):
    scenario = scenarios.BY_NAME[name]
    spec = scenario.build(0)
    straggler = "_straggler" in name
    assert any(i.kind == "slow_gpu" for i in spec.incidents) == straggler
    assert spec.duration_s == (960.0 if straggler else scenarios.UNEVEN_HEALTHY_S)
    assert all((j.hpc_job is None) == name.endswith("_unattributed") for j in spec.jobs)
    assert scenario.decoy == (not straggler)


def test_the_engine_takes_a_busier_stage_for_no_straggler_and_names_a_real_one():
    from gpufleet.server.replay import run_replay

    work = (1.0,) * 6 + (1.15, 1.15)
    healthy = generate(_job(rank_work=work))
    assert not [a for a in run_replay(healthy.lines) if a.kind.value == "straggler"]
    spec = scenarios.BY_NAME["uneven_pipeline_straggler"].build(0)
    trace = generate(spec)
    result = scenarios.score(run_replay(trace.lines), trace.truths, trace_end=spec.t0 + spec.duration_s)
    assert result.kinds["straggler"].required == 1
    assert result.kinds["straggler"].detected == 1 and result.kinds["straggler"].fp == 0
