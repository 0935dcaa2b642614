"""Peers of uneven ranks without attribution: two jobs of different loads sharing nodes are two inferred
jobs, an expert whose load drifted up is named only while busier than its peers, and a pipeline stage
carried into the inferred job does not stand out by its role."""

from __future__ import annotations

import numpy as np
import pytest

from bench.evaluation import scenarios
from bench.evaluation.tracegen import generate
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.inference import _level_parts
from gpufleet.server.replay import run_replay


def _stragglers(name: str, seed: int, config: dict | None = None) -> tuple[list, scenarios.Score]:
    """The straggler alerts of one catalog scenario's replay, and its score."""
    spec = scenarios.BY_NAME[name].build(seed)
    trace = generate(spec)
    alerts = run_replay(trace.lines, config)
    score = scenarios.score(alerts, trace.truths, trace_end=spec.t0 + spec.duration_s)
    return [a for a in alerts if a.kind.value == "straggler"], score


def test_two_levels_each_on_every_node_are_two_jobs():
    node = np.repeat([0, 1], 8)
    level = np.tile([0.66] * 4 + [0.51] * 4, 2)
    low, high = _level_parts(level, node, EngineConfig())
    assert low.tolist() == (level < 0.6).tolist() and high.tolist() == (level > 0.6).tolist()


@pytest.mark.parametrize(
    "level",
    [
        np.r_[[0.64] * 12, [0.74] * 4],  # the last pipeline stage: busier, on one node only
        np.r_[[0.64] * 15, [0.85]],  # one straggler: no part of a job's size
        np.r_[np.linspace(0.6, 0.66, 16)],  # experts' load spread without a gap
    ],
)
def test_a_role_a_straggler_or_a_spread_keeps_one_job(level):
    parts = _level_parts(level, np.repeat([0, 1], 8), EngineConfig())
    assert len(parts) == 1 and parts[0].all()


def test_levels_spread_as_widely_within_each_part_as_between_them_keep_one_job():
    # A job's ramp-up or noise spreads its GPUs' levels: a gap of 8 % between 108 and 117 W is no wider
    # than the spread above it (117 to 135 W).
    level = np.array([100.0, 117.0, 104.0, 125.0, 108.0, 135.0])
    parts = _level_parts(level, np.array([0, 0, 1, 1, 0, 1]), EngineConfig())
    assert len(parts) == 1 and parts[0].all()


def test_a_split_needs_a_gap_of_the_configured_size():
    level, node = np.tile([0.66] * 4 + [0.51] * 4, 2), np.repeat([0, 1], 8)
    assert len(_level_parts(level, node, EngineConfig(inferred_split_level_ratio=0.35))) == 1


def test_two_unattributed_jobs_sharing_nodes_raise_no_straggler_over_an_hour():
    # At 10 s sampling their ranks' wobbles hardly differ, and they were inferred as one job: the busier
    # job's GPUs, or both nodes at once, were named against the median of the two.
    for seed in (3, 4):
        named, _ = _stragglers("uneven_shared_nodes_unattributed", seed)
        assert named == []
    named, _ = _stragglers("uneven_shared_nodes_unattributed", 4, {"inferred_split_level_ratio": 10.0})
    assert named


def test_a_busier_stage_carried_into_its_inferred_job_is_not_named_beside_the_straggler():
    # The inferred job formed from its nodes' groups just before the straggler: the last stage's GPUs
    # carried offsets learned against their own node, and stood out by their role once the job slowed.
    named, score = _stragglers("uneven_pipeline_straggler_unattributed", 3)
    assert [(a.node, a.gpu) for a in named] == [("dgx-001", 7)]
    assert score.kinds["straggler"].detected == 1


def test_a_drifting_expert_no_busier_than_its_peers_is_not_named():
    named, score = _stragglers("uneven_moe_straggler_unattributed", 1)
    assert score.kinds["straggler"].detected == 1
    assert ("dgx-001", 1) not in [(a.node, a.gpu) for a in named]


def test_a_node_of_the_last_stage_carried_into_its_inferred_job_is_not_named():
    named, score = _stragglers("uneven_pipeline_straggler_unattributed", 1)
    assert score.kinds["straggler"].detected == 1 and score.kinds["straggler"].fp == 0
    assert all(a.gpu is not None for a in named)


def test_a_straggler_is_named_while_a_busier_stage_node_stands_out_at_the_weaker_margins():
    # The last stage's node stands out at the weaker margins once the job waits; that held back every GPU
    # of the job, the straggler on another node standing out far above its peers included.
    named, score = _stragglers("uneven_pipeline_straggler", 2)
    assert [(a.node, a.gpu) for a in named] == [("dgx-002", 2)]
    assert score.kinds["straggler"].detected == 1


def test_a_capped_nodes_victims_spinning_at_full_clocks_are_not_named_for_it():
    # Every GPU of the node waiting for the capped one draws more power than it, each standing out
    # cross-section: they are the capped node's victims, and only that node is named.
    named, _ = _stragglers("node_power_cap", 15)
    assert [(a.node, a.gpu) for a in named] == [("dgx-002", None)]
