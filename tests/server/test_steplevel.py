"""The step-level model (bench/evaluation/steplevel.py): its physics, its lines through the server's contract,
its truths, and the engine on its traces.

The model is the evaluation's second opinion, written apart from tracegen: these tests pin what makes it
one (ranks move together because every step waits for the slowest rank; a straggler's severity is what it
costs the job), not any threshold of the engine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import orjson
import pytest

from bench.evaluation import scenarios, steplevel
from bench.evaluation.steplevel import QUIET, Cell, StepJob, StepSpec, StepStraggler, generate
from gpufleet.server.contract import COLUMN, parse_line


def _spec(slowdown: float = 0.0, size: int = 16, interval_s: float = 5.0, hpc: str | None = "7001", **kw) -> StepSpec:
    straggler = StepStraggler(5, 240.0, 570.0, slowdown) if slowdown else None
    return StepSpec(StepJob(size, hpc), straggler, QUIET, interval_s, 630.0, seed=3, **kw)


def _readings(trace, field: str) -> np.ndarray:
    """(samples, GPUs) of one reading, in rank order."""
    rows: dict[float, dict[tuple[str, int], float]] = {}
    for line in trace.lines:
        snap = orjson.loads(line)
        t = round(snap["time"] - trace.spec.t0)
        for gpu in snap["gpus"]:
            rows.setdefault(t, {})[(snap["node"], gpu["index"])] = gpu[field]
    keys = sorted(next(iter(rows.values())))
    return np.array([[row[k] for k in keys] for _, row in sorted(rows.items())])


def test_the_solved_factor_slows_the_job_by_the_share_asked():
    for slowdown in (0.03, 0.10, 0.25):
        trace = generate(_spec(slowdown))
        assert trace.measured_slowdown == pytest.approx(slowdown, abs=1e-3)
        assert trace.factor > 1.0


def test_a_larger_job_needs_a_slower_rank_for_the_same_job_slowdown():
    # The slowest of more ranks already sets a later pace: the straggler must fall further behind.
    small, large = generate(_spec(0.05, size=16)), generate(_spec(0.05, size=256))
    assert large.factor > small.factor


def test_ranks_move_together_and_peers_wait_for_the_straggler():
    trace = generate(_spec(0.25))
    sm, util = _readings(trace, "sm_active_ratio"), _readings(trace, "utilization_ratio")
    before, during = slice(10, 45), slice(55, 110)  # sample rows at 5 s: 50-225 s and 275-550 s
    peers = np.delete(np.arange(16), 5)
    # Every rank spins in the collective while it waits: utilization stays high across the job.
    assert util[during].min() > 0.9
    # The waiting peers lose SM activity against their own earlier level; the straggler keeps computing.
    assert sm[during][:, peers].mean() < 0.9 * sm[before][:, peers].mean()
    assert sm[during, 5].mean() > sm[during][:, peers].mean() * 1.2
    # Without any job-wide draw, a rank's readings still rise and fall with its peers': every step's wait
    # is set by the same slowest rank.
    steps_only = replace(_spec(), noise=steplevel.Noise("steps only", 0.03, 0.0, 0.5))
    healthy = _readings(generate(steps_only), "sm_active_ratio")[10:]
    others = np.delete(healthy, 0, axis=1).mean(axis=1)
    assert np.corrcoef(healthy[:, 0], others)[0, 1] > 0.3


def test_lines_pass_the_servers_contract():
    trace = generate(_spec(0.10, size=12))
    samples = [parse_line(line) for line in trace.lines]
    assert {s.node for s in samples} == {steplevel.node_name(0), steplevel.node_name(1)}
    assert sum(len(s.indices) for s in samples) == trace.gpu_samples
    util = np.concatenate([s.values[:, COLUMN["utilization_ratio"]] for s in samples])
    assert not np.isnan(util).any() and util.max() <= 1.0


def test_a_straggler_is_required_from_three_percent_of_the_job():
    assert [t.required for t in generate(_spec(0.03)).truths].count(True) == 1
    marginal = generate(_spec(0.015))
    assert marginal.truths and not any(t.required for t in marginal.truths)
    assert not generate(_spec()).truths


def test_unattributed_lines_carry_no_job():
    trace = generate(_spec(0.10, hpc=None))
    assert all(g["hpc_job"] is None for line in trace.lines for g in orjson.loads(line)["gpus"])
    assert all(t.hpc_job is None for t in trace.truths)


def test_the_grid_holds_every_size_sampling_and_slowdown():
    cells = steplevel.grid()
    assert {c.size for c in cells} == set(steplevel.SIZES)
    assert {c.interval_s for c in cells} == set(steplevel.INTERVALS_S)
    assert {c.slowdown for c in cells} == {0.0, *steplevel.SLOWDOWNS}
    assert {c.attributed for c in cells} == {True, False}


def test_the_engine_names_a_quarter_slowdown_and_nothing_in_a_healthy_job():
    from gpufleet.server.replay import run_replay

    cell = Cell(16, 5.0, QUIET, 0.25, True)
    found = steplevel.run_cell(run_replay, cell, range(1))
    assert (found.required, found.found_in_time, found.fp) == (1, 1, 0)
    healthy = steplevel.run_cell(run_replay, replace(cell, slowdown=0.0), range(1))
    assert (healthy.required, healthy.fp) == (0, 0)


def test_the_limit_table_names_the_smallest_slowdown_found_every_time():
    def result(slowdown: float, found: int) -> steplevel.CellResult:
        return steplevel.CellResult(Cell(16, 5.0, QUIET, slowdown, True), 5, 5 if slowdown else 0, found, found)

    rows = [result(0.0, 0), result(0.03, 4), result(0.05, 5), result(0.10, 5), result(0.25, 5)]
    table = steplevel.render_limit(rows, 5)
    assert "| 16 | 5 | quiet | 5% |" in table
    assert "3%: 4/5" in table


def test_scoring_is_the_suites():
    trace = generate(_spec(0.10))
    truth = next(t for t in trace.truths if t.required)
    alert = {"kind": "straggler", "node": truth.node, "gpu": truth.gpu, "started": truth.start + 60.0}
    assert scenarios.score([alert], trace.truths).kinds["straggler"].detected == 1
