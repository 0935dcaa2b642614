"""Peer groups inferred without attribution from how GPUs' readings move together."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.inference import NONE, JobInference, average_linkage, lagged_correlation, wobbles


def _jobs(bins: int, layout: list[int], rng: np.random.Generator, own: float = 0.5) -> np.ndarray:
    """(bins, GPUs) SM activity: each job's GPUs share its step-phase wobble, plus their own noise of
    `own` times its size. layout: the job of each GPU."""
    n_jobs = max(layout) + 1
    shared = rng.standard_normal((bins, n_jobs))
    mine = rng.standard_normal((bins, len(layout)))
    return 0.6 + 0.02 * (shared[:, layout] + own * mine)


def _clusters(series: np.ndarray, min_corr: float = 0.3) -> np.ndarray:
    z, ok = wobbles(series, 3.0)
    return average_linkage(lagged_correlation(z, ok, 20), min_corr)


def test_gpus_of_one_job_cluster_together_and_apart_from_another_job():
    layout = [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]
    labels = _clusters(_jobs(60, layout, np.random.default_rng(7)))
    first, second = labels[np.array(layout) == 0], labels[np.array(layout) == 1]
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]


def test_a_node_sampling_one_bin_later_still_moves_with_its_job():
    series = _jobs(61, [0] * 8, np.random.default_rng(3))
    # GPUs 4-7 on a node whose samples land one bin later: the same wobbles, shifted by a bin.
    series = np.concatenate([series[1:, :4], series[:-1, 4:]], axis=1)
    assert len(set(_clusters(series).tolist())) == 1


def test_readings_that_never_change_are_no_evidence():
    series = np.full((60, 6), 0.8)
    series[30:] = 0.6  # every GPU steps at once, and never wobbles otherwise
    labels = _clusters(series)
    assert len(set(labels.tolist())) == 6


def test_one_step_shared_by_two_jobs_does_not_join_them():
    layout = [0, 0, 0, 0, 1, 1, 1, 1]
    series = _jobs(60, layout, np.random.default_rng(11))
    series[30:] -= 0.2  # both jobs' readings drop in the same bin (a shared file system stalls)
    labels = _clusters(series)
    assert labels[0] != labels[4]


def test_unrelated_gpus_form_no_cluster_big_enough_to_be_a_job():
    # One pair can correlate by chance; a job needs straggler_min_group GPUs moving together.
    for seed in range(5):
        labels = _clusters(_jobs(60, list(range(12)), np.random.default_rng(seed)))
        assert np.bincount(labels).max() < EngineConfig().straggler_min_group


class _Window:
    """Just what JobInference reads of the engine's windows: recent(k, bins, rows) newest first."""

    def __init__(self, sm: np.ndarray) -> None:
        self.sm = sm  # (bins, n) oldest first
        self.ring = 60
        self.slot_node_id = np.zeros(sm.shape[1], dtype=np.int64)  # one node

    def recent(self, k: int, n_bins: int, rows) -> np.ndarray:
        sm = self.sm[max(0, k + 1 - n_bins) : k + 1][::-1]
        power = 500.0 * sm
        util = np.full_like(sm, 0.98)
        return np.stack([sm, power, util], axis=1)


def test_labels_stay_with_a_job_across_reinference_and_a_job_in_trouble_is_held():
    cfg = EngineConfig()
    layout = [0, 0, 0, 0, 1, 1, 1, 1]
    series = _jobs(200, layout, np.random.default_rng(2))
    inf = JobInference(cfg)
    running, model = np.ones(8, dtype=bool), np.zeros(8, dtype=np.int64)
    labels = None
    for k in range(0, 120):
        labels = inf.update(k, _Window(series), running, model)
    assert labels is not None and (labels != NONE).all()
    assert len(set(labels[:4].tolist())) == 1 and len(set(labels[4:].tolist())) == 1 and labels[0] != labels[4]
    # The second job's GPUs stop moving together (an incident): held while in trouble, they stay its GPUs.
    series[120:, 4:] = 0.6 + 0.02 * np.random.default_rng(9).standard_normal((80, 4))
    hold = np.array([False] * 4 + [True] * 4)
    for k in range(120, 200):
        held = inf.update(k, _Window(series), running, model, hold)
    assert (held == labels).all()
    # Not held, they are re-inferred as no job at all; the first job keeps its label.
    after = inf.update(200 + cfg.bins(cfg.inferred_refresh_seconds), _Window(series), running, model)
    assert (after[:4] == labels[:4]).all() and (after[4:] == NONE).all()


def test_a_gpu_that_stops_running_leaves_its_inferred_job():
    cfg = EngineConfig()
    series = _jobs(130, [0] * 6, np.random.default_rng(4))
    inf = JobInference(cfg)
    running, model = np.ones(6, dtype=bool), np.zeros(6, dtype=np.int64)
    for k in range(0, 120):
        labels = inf.update(k, _Window(series), running, model)
    assert (labels != NONE).all()
    running[5] = False
    assert inf.update(121, _Window(series), running, model)[5] == NONE


def test_many_jobs_are_not_joined_by_chance_correlation_of_their_step_phases():
    # Over one window two jobs' step phases correlate by chance; among 16 jobs of 128 GPUs this draw has
    # a pair doing so strongly enough to pass the absolute threshold. Their GPUs move with each other far
    # less than within each job, so they stay apart.
    cfg = EngineConfig()
    layout = np.repeat(np.arange(16), 128)
    z, ok = wobbles(_jobs(60, layout.tolist(), np.random.default_rng(0)), cfg.inferred_clip_sigmas)
    corr = lagged_correlation(z, ok, 20)
    assert len(set(average_linkage(corr, cfg.inferred_min_correlation).tolist())) < 16  # what the draw does
    labels = average_linkage(corr, cfg.inferred_min_correlation, cfg.inferred_min_relative_correlation)
    assert all(len(set(labels[layout == j].tolist())) == 1 for j in range(16))
    assert len(set(labels.tolist())) == 16


def test_sampling_interval_is_read_from_each_gpus_own_span():
    from gpufleet.server.engine.inference import _fill

    held = np.zeros((60, 4), dtype=bool)  # newest first: the trace began 20 bins ago
    held[1:21:2] = True  # a sample every other bin (10 s agents, 5 s ticks)
    assert _fill(held) == 0.5
    assert _fill(np.zeros((60, 4), dtype=bool)) == 0.0


class _Nodes(_Window):
    """_Window with each GPU on the node `nodes` gives it."""

    def __init__(self, sm: np.ndarray, nodes: list[int]) -> None:
        super().__init__(sm)
        self.ring = 60
        self.slot_node_id = np.asarray(nodes, dtype=np.int64)


def _infer_until(inf: JobInference, w: _Window, k_end: int, k_start: int = 0) -> np.ndarray:
    n = w.sm.shape[1]
    running, model = np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64)
    labels = np.full(n, NONE)
    for k in range(k_start, k_end):
        labels = inf.update(k, w, running, model)
    return labels


def test_a_gpu_that_stops_moving_with_its_job_stays_in_it_while_the_job_holds_its_node():
    # A straggler computes through the steps its peers wait in: its wobble leaves theirs. Re-inferred
    # alone, it had no peers to be named against.
    cfg = replace(EngineConfig(), inferred_node_join_min_correlation=1.0)  # the keep alone
    nodes = [0] * 8 + [1] * 8
    series = _jobs(400, [0] * 16, np.random.default_rng(5))
    series[120:, 3] = 0.6 + 0.02 * np.random.default_rng(6).standard_normal(280)  # GPU 3 moves alone
    inf = JobInference(cfg)
    job = _infer_until(inf, _Nodes(series, nodes), 120)
    assert (job == job[0]).all() and job[0] != NONE
    refresh = cfg.bins(cfg.inferred_refresh_seconds)
    later = _infer_until(inf, _Nodes(series, nodes), 120 + 2 * refresh, 120)
    assert (later == job[0]).all()
    # Once its window no longer holds its moving with the job, and the keep ran out: no job.
    end = 120 + 60 + cfg.bins(cfg.inferred_keep_seconds) + 2 * refresh
    gone = _infer_until(inf, _Nodes(series, nodes), end, 120 + 2 * refresh)
    assert gone[3] == NONE and (np.delete(gone, 3) == job[0]).all()


def test_a_gpu_of_a_node_its_job_left_is_not_kept_in_the_job():
    # Another job's GPUs (node 1) moved with this one for a while, then apart: they leave with their node.
    cfg = EngineConfig()
    nodes = [0] * 8 + [1] * 4
    series = _jobs(300, [0] * 12, np.random.default_rng(5))
    series[120:, 8:] = _jobs(180, [1] * 4, np.random.default_rng(8))[:, :4] + 0.1
    inf = JobInference(cfg)
    first = _infer_until(inf, _Nodes(series, nodes), 120)
    assert (first == first[0]).all()
    later = _infer_until(inf, _Nodes(series, nodes), 300, 120)
    assert (later[:8] == first[0]).all() and (later[8:] != first[0]).all()


def test_a_gpu_that_moves_with_its_job_only_weakly_joins_it_where_the_job_holds_its_node():
    # Its wobble correlates with its job's about 0.2, too little for average linkage. On node 0 the job
    # holds its seven other GPUs; on node 2 four of them, the other three another job's GPUs, each on
    # its own: there the weak GPU is not taken for the job's.
    cfg = EngineConfig()
    rng = np.random.default_rng(12)
    nodes = [0] * 8 + [1] * 8 + [2] * 8
    shared = rng.standard_normal((60, 1))
    series = 0.6 + 0.02 * (shared + 0.5 * rng.standard_normal((60, 24)))
    for weak in (7, 23):
        series[:, weak] = 0.6 + 0.02 * (0.23 * shared[:, 0] + rng.standard_normal(60))
    series[:, 16:19] = 0.6 + 0.02 * rng.standard_normal((60, 3))
    w = _Nodes(series, nodes)
    labels = _infer_until(JobInference(cfg), w, 60)
    job = labels[0]
    assert job != NONE and (labels[:16] == job).all() and (labels[19:23] == job).all()
    assert labels[23] == NONE and (labels[16:19] != job).all()
    # Without the node's prior, GPU 7 stays out too.
    alone = JobInference(replace(cfg, inferred_node_join_min_correlation=1.0))
    assert _infer_until(alone, w, 60)[7] == NONE
