"""A straggler too small for the activity margins, named by its step (detectors/straggler/steps.py): its
standing against its peers rises at one moment while theirs falls; a rank whose load drifts is not."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.detectors.straggler.steps import Peers, StepTrail, Stretch, _ring_bins, find_steps
from gpufleet.server.engine.windows import B_SM, N_BINNED
from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines

ONSET_S = 400.0
CULPRIT = ("n1", 3)
PEER_FALL = 0.03  # the job slows 3 %: its waiting peers lose that share of their SM activity


def _noisy(level: float, t: float, node: str, gpu: int) -> float:
    """SM activity with 0.5 % sensor noise, the same for the same sample in every run."""
    return level * (1.0 + 0.005 * np.random.default_rng([int(t), int(node[1:]), gpu]).standard_normal())


def _slowed(culprit_rise: float, peer_fall: float):
    """From ONSET_S the culprit's SM activity is culprit_rise(t) above 0.80 and its peers' peer_fall(t)
    below (shares, 0 before the onset)."""

    def override(t: float, node: str, gpu: int) -> dict[str, float]:
        if (node, gpu) == CULPRIT:
            return {"sm_active_ratio": _noisy(0.80 * (1.0 + culprit_rise(t)), t, node, gpu)}
        return {"sm_active_ratio": _noisy(0.80 * (1.0 - peer_fall(t)), t, node, gpu)}

    return override


def _stragglers(override, seconds: float = 1000.0, config=None):
    alerts = run_replay(cluster_lines(seconds, override=override), config)
    return [a for a in alerts if a.kind.value == "straggler"]


def _at_once(share: float):
    return lambda t: share if t >= ONSET_S else 0.0


def test_a_gpu_that_slows_its_job_3_percent_at_once_is_named_by_its_step():
    # It computes 2.5 % longer per step while its 15 peers wait 3 % longer: it stands 5.7 % above them,
    # under the 10 % SM-activity margin, and the job's 3 % fall is under the 4 % slowdown margin.
    slowed = _slowed(_at_once(0.025), _at_once(PEER_FALL))
    (s,) = _stragglers(slowed)
    assert (s.node, s.gpu, s.hpc_job) == (*CULPRIT, "j1")
    assert T0 + ONSET_S < s.started <= T0 + ONSET_S + 300
    assert 0.04 < s.evidence["step_rise_vs_peers"] < 0.08
    assert 0.02 < s.evidence["step_job_fall"] < 0.04
    assert s.evidence["estimated_job_slowdown_ratio"] >= s.evidence["step_job_fall"]
    assert "at once" in s.summary
    # Without the step rules the margins alone name nobody: the step is what finds it.
    assert _stragglers(slowed, config={"disabled_rules": ["straggler_step"]}) == []


def test_the_same_rise_as_a_drift_is_not_named():
    # The same rise and fall, reached over four minutes (a mixture-of-experts rank taking on more load):
    # within each stretch the GPU moves as much as between them. No step, no straggler.
    def ramp(share: float):
        return lambda t: share * min(max((t - ONSET_S) / 240.0, 0.0), 1.0)

    drift = _slowed(ramp(0.025), ramp(PEER_FALL))
    assert _stragglers(drift) == []
    # Its rise and its job's fall are as large as the step's: only the ramp within the stretches tells it.
    assert len(_stragglers(drift, config={"straggler_step_ramp_ratio": 100.0})) == 1


def test_a_gpu_stepping_up_while_its_job_does_not_fall_is_not_named():
    # A rank whose share of the work changed at once, with the job's pace unchanged: nobody waits for it.
    changed = _slowed(_at_once(0.06), _at_once(0.0))
    assert _stragglers(changed) == []
    assert len(_stragglers(changed, config={"straggler_step_min_slowdown": 0.0})) == 1


def test_a_named_step_clears_once_the_gpu_is_back():
    def back(share: float):
        return lambda t: share if ONSET_S <= t < 800.0 else 0.0

    (s,) = _stragglers(_slowed(back(0.025), back(PEER_FALL)), seconds=1100.0)
    assert s.resolved is not None and T0 + 800 <= s.resolved <= T0 + 800 + 120


def test_a_3_percent_straggler_in_an_inferred_job_is_named_by_its_step():
    # The step-level model's job of 16 GPUs without hpc_job, at 5 s sampling: its ranks move together,
    # so inference groups them, and one GPU slows the job 3 % (seed 0: GPU 7 of the first node).
    from bench.evaluation import steplevel

    cell = steplevel.Cell(16, 5.0, steplevel.QUIET, 0.03, attributed=False)
    trace = steplevel.generate(cell.spec(0))
    (truth,) = [t for t in trace.truths if t.required]

    def stragglers(config=None):
        return [a for a in run_replay(trace.lines, config) if a.kind.value == "straggler"]

    (s,) = stragglers()
    assert (s.node, s.gpu, s.hpc_job) == (truth.node, truth.gpu, None)
    assert s.evidence["peer_group_inferred"] and "step_rise_vs_peers" in s.evidence
    assert truth.start < s.started <= truth.start + steplevel.WITHIN_S
    # The margins alone name nobody in a job this slowed.
    assert stragglers({"disabled_rules": ["straggler_step"]}) == []


def _unattributed(override, seconds: float = 1000.0):
    alerts = run_replay(cluster_lines(seconds, override=override, job=None))
    return [a for a in alerts if a.kind.value == "straggler"]


def test_a_3_percent_straggler_in_no_inferred_job_is_named_against_its_node():
    # No hpc_job, and each GPU's noise its own: nothing moves together, inference finds no job, and each
    # GPU's peers are its node's busy GPUs. The straggler's 7 node-mates wait for it as every rank does.
    slowed = _slowed(_at_once(0.025), _at_once(PEER_FALL))
    (s,) = _unattributed(slowed)
    assert (s.node, s.gpu, s.hpc_job) == (*CULPRIT, None)
    assert T0 + ONSET_S < s.started <= T0 + ONSET_S + 300
    assert s.evidence["peer_group"] == "node_model" and s.evidence["peer_group_inferred"] is True
    assert s.evidence["step_peers"] == "node" and 0.04 < s.evidence["step_rise_vs_peers"] < 0.08


def test_a_job_ending_on_half_a_node_is_no_step_of_the_other_half():
    # Two unattributed jobs share node n1: GPUs 0-3 at 60 % SM activity, 4-7 at 90 %. The busier job
    # ends: the node's busy median falls to the first job's level, and each of its four GPUs stands 25 %
    # higher against it than before, flat, as the median fell. Four GPUs stepping at once are a change
    # of work, not a straggler (straggler_mixed_standout_share).
    def two_jobs(t: float, node: str, gpu: int) -> dict[str, float]:
        if node != "n1":
            return {"sm_active_ratio": _noisy(0.80, t, node, gpu)}
        if gpu >= 4 and t >= ONSET_S:
            return {"sm_active_ratio": 0.0, "utilization_ratio": 0.0, "power_watts": 80.0}
        return {"sm_active_ratio": _noisy(0.60 if gpu < 4 else 0.90, t, node, gpu)}

    assert _unattributed(two_jobs) == []
    named = run_replay(cluster_lines(1000, override=two_jobs, job=None), {"straggler_mixed_standout_share": 1.0})
    assert {(a.node, a.gpu) for a in named if a.kind.value == "straggler"} == {("n1", g) for g in range(4)}


def test_a_gpu_of_an_inferred_job_is_judged_against_its_node_until_its_job_can_judge_it():
    # The step-level model's 64-GPU job at 1 s sampling, seed 2: inference holds the job only from a
    # minute before the straggler starts, too late for the job's two stretches; against its node's GPUs
    # the straggler is named within the five minutes.
    from bench.evaluation import steplevel

    cell = steplevel.Cell(64, 1.0, steplevel.QUIET, 0.03, attributed=False)
    trace = steplevel.generate(cell.spec(2))
    (truth,) = [t for t in trace.truths if t.required]
    (s,) = [a for a in run_replay(trace.lines) if a.kind.value == "straggler"]
    assert (s.node, s.gpu, s.hpc_job) == (truth.node, truth.gpu, None)
    assert s.evidence["step_peers"] == "node" and s.evidence["peer_group"] == "inferred_job"
    assert truth.start < s.started <= truth.start + steplevel.WITHIN_S


def test_a_gpu_of_an_inferred_job_sharing_its_node_with_another_job_is_not_judged_against_the_node():
    # Two unattributed jobs share every node (the uneven scenario, seed 0). A GPU's node-mates of the
    # other job change their work on their own schedule: set against the node's median, one of this
    # job's GPUs stepped 3 % up as the node fell 4 %, a false straggler. Its job holds only part of the
    # node, so its job alone judges it.
    from bench.evaluation import scenarios
    from bench.evaluation.tracegen import generate, without_fields

    trace = generate(scenarios.BY_NAME["uneven_shared_nodes_straggler_unattributed"].build(0))
    alerts = run_replay(without_fields(list(trace.lines), ("hpc_job",)))
    stragglers = [a for a in alerts if a.kind.value == "straggler"]
    assert stragglers and not any(a.evidence.get("step_peers") == "node" for a in stragglers)


def test_a_step_within_the_gpus_own_noise_is_not_named():
    # The same 3 % step, on a GPU whose own readings swing 12 % from sample to sample (a noisy sensor, or a
    # rank whose load swings within each step): its two stretches' means are that uncertain, and a rise
    # of a few standard errors is what such a GPU shows by chance. Its quiet peers do not widen the spread
    # of the group's rises, so only its own noise tells it.
    def swinging(t: float, node: str, gpu: int) -> dict[str, float]:
        share = 0.025 if t >= ONSET_S else 0.0
        if (node, gpu) == CULPRIT:
            swing = 0.12 * np.random.default_rng([int(t), 7]).standard_normal()
            return {"sm_active_ratio": 0.80 * (1.0 + share) * (1.0 + swing)}
        return {"sm_active_ratio": _noisy(0.80 * (1.0 - (PEER_FALL if t >= ONSET_S else 0.0)), t, node, gpu)}

    assert _stragglers(swinging) == []
    # Its noisy stretches leave the slope within them as uncertain: that gate is lifted too.
    named = _stragglers(swinging, config={"straggler_step_noise_sigmas": 0.0, "straggler_step_ramp_sigmas": 0.0})
    assert [(s.node, s.gpu) for s in named] == [CULPRIT]


def _filled_trail(n: int, ticks: range, cfg) -> StepTrail:
    """A trail holding a bin of deviations and levels (some missing) for each of `ticks`, as _record
    leaves them."""
    trail = StepTrail()
    trail.fit(n, _ring_bins(cfg))
    rng = np.random.default_rng(5)
    for k in ticks:
        row = k % len(trail.tick_of)
        trail.dev[row] = np.where(rng.random(n) < 0.1, np.nan, rng.normal(0.0, 0.02, n))
        trail.level[row] = np.where(rng.random(n) < 0.1, np.nan, rng.uniform(0.5, 0.9, n))
        trail.tick_of[row] = k
    return trail


def _same(a: Stretch, b: Stretch) -> bool:
    """Every field of two stretches holds the same bits."""
    return all(getattr(a, f).tobytes() == getattr(b, f).tobytes() for f in Stretch.__slots__)


def test_the_older_stretch_kept_from_a_gap_and_a_stretch_ago_is_the_one_worked_out_afresh():
    cfg = EngineConfig()
    a, gap = cfg.bins(cfg.straggler_step_window_seconds), cfg.bins(cfg.smooth_seconds)
    trail = _filled_trail(64, range(0), cfg)
    rng = np.random.default_rng(6)
    for k in range(200):
        if k % 37 == 36 or 120 <= k < 125:
            continue  # ticks not evaluated (a silence the engine skips): their rows hold older ticks
        row = k % len(trail.tick_of)
        trail.dev[row] = np.where(rng.random(64) < 0.1, np.nan, rng.normal(0.0, 0.02, 64))
        trail.level[row] = rng.uniform(0.5, 0.9, 64)
        trail.tick_of[row] = k
        after, before = trail.stretches(k, a, gap)
        assert _same(after, trail.stretch(k, 0, a))
        assert _same(before, trail.stretch(k, a + gap, a))


def test_a_forgotten_gpu_is_not_read_from_a_kept_stretch():
    cfg = EngineConfig()
    a, gap = cfg.bins(cfg.straggler_step_window_seconds), cfg.bins(cfg.smooth_seconds)
    trail = _filled_trail(16, range(100), cfg)
    for k in range(100 - a - gap, 100):
        trail.stretches(k, a, gap)  # keeps each tick's newer stretch
    trail.forget(np.array([3]))
    _, before = trail.stretches(100, a, gap)
    assert before.count[3] == 0
    assert _same(before, trail.stretch(100, a + gap, a))


def test_a_tick_with_nothing_judged_is_recorded_as_find_steps_records_it():
    cfg = EngineConfig()
    n, k = 16, 130
    skipped, tested = _filled_trail(n, range(k), cfg), _filled_trail(n, range(k), cfg)
    skipped.pass_tick(k, n, cfg)
    tick = SimpleNamespace(k=k, config=cfg, latest=np.full((N_BINNED, n), 0.7), held=np.ones((1, n), dtype=bool))
    peers = Peers(np.zeros(n, dtype=np.int64), np.array([n]), lambda row: np.full((len(row), 1), np.nan))
    nothing = np.zeros(n, dtype=bool)
    steps = find_steps(tick, tested, peers, nothing, nothing, nothing)  # type: ignore[arg-type]
    assert not steps.on.any()
    for name in ("dev", "level", "tick_of", "since", "before", "size", "fall"):
        assert getattr(skipped, name).tobytes() == getattr(tested, name).tobytes(), name


def _first_step_of_a_noisy_ramp(cfg, seed: int, n: int = 16) -> int | None:
    """The first tick at which find_steps holds a step for GPU 0, whose SM activity climbs 12 % over 120
    ticks (a drifting expert) while its peers fall 6 %, every bin off by 3 % noise: a ramp whose slope
    within 24-bin stretches is itself uncertain."""
    rng = np.random.default_rng(seed)
    trail = StepTrail()
    peers = Peers(np.zeros(n, dtype=np.int64), np.array([n]), lambda row: np.nanmedian(row, axis=1)[:, None])
    every = np.ones(n, dtype=bool)
    for k in range(200):
        share = min(max((k - 60) / 120, 0.0), 1.0)
        latest = np.full((N_BINNED, n), 0.7)
        latest[B_SM] = 0.8 * (1.0 - 0.06 * share) * (1.0 + 0.03 * rng.standard_normal(n))
        latest[B_SM, 0] = 0.8 * (1.0 + 0.12 * share) * (1.0 + 0.03 * rng.standard_normal())
        tick = SimpleNamespace(k=k, config=cfg, latest=latest)
        if find_steps(tick, trail, peers, every, ~every, every).on[0]:  # type: ignore[arg-type]
            return k
    return None


def test_a_noisy_ramp_whose_slope_reads_flat_by_chance_is_not_named():
    # Mid-ramp its stretches' slope, read from noisy bins, explains under half the rise on some tick: the
    # flat gate alone takes it for a step. The slope's own standard error keeps a ramp in the running.
    cfg = EngineConfig()
    assert _first_step_of_a_noisy_ramp(cfg, seed=3) is None
    assert _first_step_of_a_noisy_ramp(replace(cfg, straggler_step_ramp_sigmas=0.0), seed=3) is not None
