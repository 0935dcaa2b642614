"""Peer groups on whole traces of fleets without attribution: what an inferred job's GPUs learned before
inference carries over, a GPU of another job that moved with it for a while is not named, and neither is
a node or GPU waiting for the culprit.

The traces are probes of bench/evaluation/probes.py at the frozen generator version; each test fixes its draw."""

from __future__ import annotations

import pytest

from bench.evaluation import probes
from bench.evaluation.tracegen import generate
from gpufleet.server.alerts import AlertKind


def _replay(name: str, seed: int):
    from gpufleet.server.replay import run_replay

    trace = generate(probes.BY_NAME[name].build(seed))
    return trace, [a for a in run_replay(trace.lines) if a.kind == AlertKind.STRAGGLER]


def test_a_slow_gpu_starting_just_after_its_job_was_inferred_is_named():
    # Power-only A100s: the job is inferred about 240 s in and a GPU slows about 40 s later. Learning and
    # the job's baseline restarted at inference took the slowed job as its usual and the GPU was missed.
    trace, alerts = _replay("probe_a100_job_unattributed", 3)
    (truth,) = [t for t in trace.truths if t.required]
    named = [a for a in alerts if (a.node, a.gpu) == (truth.node, truth.gpu)]
    assert named and named[0].started - (truth.start - truth.lead_s) < 120.0
    assert all(a.evidence.get("peer_group_inferred") for a in named)
    assert len(alerts) == len(named)


def test_a_gpu_of_another_job_briefly_inferred_into_a_job_is_not_named():
    # Two jobs of different loads start together; for one re-inference a GPU of the busier job was
    # clustered with the other job, where its activity stood far above its new peers'.
    trace, alerts = _replay("probe_two_jobs_unattributed", 4)
    (truth,) = [t for t in trace.truths if t.required]
    assert {(a.node, a.gpu) for a in alerts} == {(truth.node, truth.gpu)}


def test_a_gpu_braked_just_after_its_inferred_job_split_is_named_by_its_cut_clocks():
    # Without attribution a job under a power cap is re-inferred as one job per node; a GPU of a node
    # whose group is that new, not yet learned, is braked: its cut clocks name it whoever its peers are.
    from bench.evaluation import scenarios
    from bench.evaluation.tracegen import without_fields
    from gpufleet.server.replay import run_replay

    trace = generate(scenarios.BY_NAME["straggler_under_power_cap"].build(4))
    alerts = [a for a in run_replay(without_fields(list(trace.lines), ("hpc_job",))) if a.kind == AlertKind.STRAGGLER]
    (truth,) = [t for t in trace.truths if t.required]
    assert [(a.node, a.gpu) for a in alerts] == [(truth.node, truth.gpu)]
    assert "SM clock" in alerts[0].summary


def test_an_inferred_job_with_one_gpu_on_another_node_names_no_node():
    # Two unattributed jobs (a whole node, and half of another) were inferred as one for a while; when the
    # whole-node job ended, its node idled against the single GPU of the other job left in the group.
    from bench.evaluation import scenarios
    from bench.evaluation.tracegen import without_fields
    from gpufleet.server.replay import run_replay

    trace = generate(scenarios.BY_NAME["decoy_idle_and_ending"].build(3))
    alerts = run_replay(without_fields(list(trace.lines), ("hpc_job",)))
    assert [a for a in alerts if a.kind == AlertKind.STRAGGLER] == []


def test_the_waiting_partner_of_a_host_starved_node_is_not_named():
    # Two power-only jobs of two nodes each, sensor noise x4. One job was inferred with two GPUs of the
    # other, on a node of their own: against the median over three nodes (its own among them), the
    # starved node's partner read as "busy while the other nodes wait" beside it.
    trace, alerts = _replay("probe_a100_two_jobs_starved_noise4_unattributed", 0)
    (truth,) = [t for t in trace.truths if t.required]
    assert {(a.node, a.gpu) for a in alerts} == {(truth.node, None)}
    assert alerts[0].evidence["pattern"] == "host_idle"


def test_a_waiting_gpu_whose_warm_up_ended_on_a_dip_is_not_named():
    # Sensor noise x4: one GPU's warm-up ended on a few ticks under its peers. Kept as its offset, that
    # dip made it read busier than it was once its node's job slowed for a straggler on the other node,
    # and it was named beside the culprit.
    trace, alerts = _replay("probe_two_jobs_noise4_unattributed", 0)
    (truth,) = [t for t in trace.truths if t.required]
    assert {(a.node, a.gpu) for a in alerts} == {(truth.node, truth.gpu)}


def test_outside_a_job_an_offset_after_its_warm_up_is_the_running_mean_of_its_readings():
    import numpy as np

    from gpufleet.server.engine.config import EngineConfig
    from gpufleet.server.engine.detectors.straggler.common import follow, learning_rate

    cfg = EngineConfig()
    warm = cfg.bins(cfg.startup_grace_seconds)
    off, yes = np.array([np.nan]), np.array([True])
    for k, x in enumerate([0.0] * (warm - 3) + [-0.11] * 3):  # a warm-up ending on a dip
        off = follow(off, np.array([x]), yes, learning_rate(cfg, np.array([k]), True))
    assert off[0] < -0.06
    for k in range(warm, warm + 22):
        off = follow(off, np.array([0.0]), yes, learning_rate(cfg, np.array([k]), True))
    assert abs(off[0]) < 0.015
    # Long after, it follows drift at the configured time constant; inside a job (an offset capped to the
    # structural range) it does so from the end of the warm-up on.
    slow = 1.0 - np.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds)
    assert learning_rate(cfg, np.array([10**6]), True)[0] == pytest.approx(slow)
    assert learning_rate(cfg, np.array([warm]), False)[0] == pytest.approx(slow)


def test_a_named_gpu_is_not_left_alone_by_an_inference_while_it_is_named():
    # A braked unattributed GPU, named by its cut clocks before it had learned, moved unlike its node's
    # other GPUs: an inference then made them a job without it and left it alone in its node's group,
    # with no peers, and its alert cleared for four minutes of the brake. A group with a GPU named is in
    # trouble: its GPU model is not re-inferred meanwhile.
    from bench.evaluation import scenarios
    from gpufleet.server.replay import run_replay

    trace = generate(scenarios.BY_NAME["straggler_unattributed"].build(4))
    (truth,) = [t for t in trace.truths if t.required]
    alerts = [a for a in run_replay(trace.lines) if a.kind == AlertKind.STRAGGLER]
    assert [(a.node, a.gpu) for a in alerts] == [(truth.node, truth.gpu)]
    assert alerts[0].resolved >= truth.end


@pytest.mark.parametrize(
    "slowdown, seed",
    [
        # The straggler wobbled against its peers from its first slowed step: the next re-inference, just
        # before they slowed enough to hold the labels, left it out of the job, alone and unjudged.
        (0.10, 1),
        # The job was first inferred just after the straggler slowed, without it; its node's other GPUs in it.
        (0.25, 1),
        (0.0, 0),  # healthy: nobody named
    ],
)
def test_an_unattributed_straggler_of_a_step_level_job_is_named_within_five_minutes(slowdown, seed):
    # bench/evaluation/steplevel.py: a synchronous job of 16 GPUs simulated step by step, sampled every
    # 5 s, no hpc_job; the straggler slows the whole job by `slowdown`.
    from bench.evaluation import scenarios, steplevel
    from gpufleet.server.replay import run_replay

    trace = steplevel.generate(steplevel.Cell(16, 5.0, steplevel.QUIET, slowdown, False).spec(seed))
    alerts = run_replay(trace.lines)
    score = scenarios.score(alerts, trace.truths, trace_end=trace.spec.t0 + trace.spec.duration_s)
    straggler = score.kinds["straggler"]
    assert straggler.fp == 0
    assert straggler.detected == straggler.required == (1 if slowdown else 0)
    assert all(t <= steplevel.WITHIN_S for t in straggler.ttf_s)
