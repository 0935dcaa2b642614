"""Peer groups: vectorised group medians, job groups and the unattributed fallbacks."""

from __future__ import annotations

import numpy as np

import pytest

from gpufleet.server.engine.groups import (
    CLUSTER_MODEL,
    JOB,
    NODE_MODEL,
    GroupLayout,
    GroupMembers,
    GroupRegistry,
    group_mean,
    group_means,
    group_median,
    group_medians,
    group_stats,
)


def test_group_median_ignores_nan_and_negative_ids():
    values = np.array([1.0, 3.0, 2.0, np.nan, 10.0, 20.0, 99.0])
    gid = np.array([0, 0, 0, 0, 1, 1, -1])
    med = group_median(values, gid, 3)
    assert med[0] == 2.0 and med[1] == 15.0 and np.isnan(med[2])


def test_jobs_group_by_name_and_unattributed_fall_back():
    reg = GroupRegistry()
    slot_job = np.array([0, 0, -1, -1, -1, -1])
    node = np.array([0, 0, 0, 0, 1, 1])
    model = np.zeros(6, dtype=np.int64)
    busy = np.array([True, True, True, False, True, True])
    gid, ngid = reg.build(100.0, slot_job, node, model, ["71001"], np.ones(6, dtype=bool), busy)
    keys = [reg.keys[g] if g >= 0 else None for g in gid]
    assert keys[0] == keys[1] == (JOB, "71001")
    assert keys[2] == (NODE_MODEL, 0, 0) and keys[3] is None and keys[4] == (NODE_MODEL, 1, 0)
    assert reg.keys[ngid[3]] == reg.keys[ngid[4]] == (CLUSTER_MODEL, 0)
    assert reg.job(gid[0]) == "71001" and reg.job(gid[2]) is None
    again, _ = reg.build(200.0, slot_job, node, model, ["71001"], np.ones(6, dtype=bool), busy)
    assert (again == gid).all() and reg.first_seen[gid[0]] == 100.0


def test_fallback_groups_of_a_model_are_its_unattributed_groups_on_every_node_and_cluster_wide():
    reg = GroupRegistry()
    slot_job = np.array([0, 0, -1, -1, -1, -1])
    node = np.array([0, 0, 0, 1, 2, 2])
    model = np.array([0, 0, 0, 0, 1, 1])
    gid, ngid = reg.build(100.0, slot_job, node, model, ["71001"], np.ones(6, dtype=bool), np.ones(6, dtype=bool))
    assert reg.fallback_groups(0) == {int(gid[2]), int(gid[3]), int(ngid[2])}
    assert reg.fallback_groups(1) == {int(gid[4]), int(ngid[4])}
    assert int(gid[0]) not in reg.fallback_groups(0) and reg.fallback_groups(7) == set()


def test_an_unattributed_node_group_restarts_when_its_busy_set_changes():
    # Without attribution, a node's busy set changing is another job starting or ending there: the
    # old group's baseline and start-up no longer describe it. The id stays, so flapping GPUs cannot
    # grow the number of groups.
    reg = GroupRegistry()
    slot_job = np.full(4, -1)
    node = np.zeros(4, dtype=np.int64)
    model = np.zeros(4, dtype=np.int64)
    seen = np.ones(4, dtype=bool)

    def build(t, busy):
        gid, _ = reg.build(t, slot_job, node, model, [], seen, np.array(busy))
        return int(gid[0]), list(reg.restarted)

    g, restarted = build(100.0, [True, True, False, False])
    assert restarted == [] and reg.first_seen[g] == 100.0
    # Found already running when the engine started: dated back. The work that restarts it is new.
    reg.backdate(np.array([g]), 90.0)
    assert reg.first_seen[g] == 10.0 and reg.dated[g]
    assert build(105.0, [True, True, False, False]) == (g, [])
    assert build(300.0, [True, True, True, True]) == (g, [g]) and reg.first_seen[g] == 300.0
    assert not reg.dated[g]
    assert build(400.0, [True, True, False, False]) == (g, [g])
    build(500.0, [False, False, False, False])  # the node idles: no group at all
    assert build(600.0, [True, True, False, False]) == (g, [g]) and reg.first_seen[g] == 600.0
    assert len(reg.keys) == 2  # the node group and the cluster group


def _slow_median(values, gid, n_groups):
    """Reference: one group at a time with np.median."""
    out = np.full(n_groups, np.nan)
    for g in range(n_groups):
        x = values[(gid == g) & ~np.isnan(values)]
        if len(x):
            out[g] = np.median(x)
    return out


def test_batched_group_medians_match_one_group_at_a_time():
    rng = np.random.default_rng(4)
    n, n_groups = 500, 37
    values = rng.normal(size=(3, n)).round(1)  # rounding makes ties
    values[rng.random((3, n)) < 0.2] = np.nan
    gid = rng.integers(-1, n_groups - 2, n)  # the last groups stay empty
    med = group_medians(values, gid, n_groups)
    assert med.shape == (3, n_groups)
    for r in range(3):
        np.testing.assert_array_equal(med[r], _slow_median(values[r], gid, n_groups))
        np.testing.assert_array_equal(med[r], group_median(values[r], gid, n_groups))
    assert np.isnan(med[:, -2:]).all()


def test_group_medians_beyond_16_bit_ids_fall_back_exactly():
    rng = np.random.default_rng(5)
    n_groups = 20_000  # 2 rows x 20,000 ids > int16
    gid = rng.integers(0, n_groups, 60_000)
    values = rng.random((2, 60_000))
    med = group_medians(values, gid, n_groups)
    np.testing.assert_array_equal(med[1], _slow_median(values[1], gid, n_groups))


def test_batched_group_means_match_one_group_at_a_time():
    values = np.array([[1.0, 2.0, np.nan, 4.0, 8.0], [0.0, 1.0, 1.0, np.nan, np.nan]])
    gid = np.array([0, 0, 0, 1, -1])
    means = group_means(values, gid, 3)
    np.testing.assert_array_equal(means[0], [1.5, 4.0, np.nan])
    np.testing.assert_array_equal(means[1], [2 / 3, np.nan, np.nan])
    np.testing.assert_array_equal(means[1], group_mean(values[1], gid, 3))


@pytest.mark.parametrize("seed", range(6))
def test_group_layout_medians_match_group_medians(seed):
    rng = np.random.default_rng(seed)
    n, n_groups = 120, 9
    ids = rng.integers(-1, n_groups - 1, n)  # the last group stays empty
    where = rng.permutation(200)[:n]  # members' columns in a wider array
    layout = GroupLayout(ids, n_groups, where)
    for nan_share in (0.0, 0.3):
        values = rng.normal(size=(4, 200)).round(1)
        values[rng.random(values.shape) < nan_share] = np.nan
        values[1] = np.nan  # an unsupported reading
        values[2, where[ids == 0]] = np.nan  # a group without this reading
        np.testing.assert_array_equal(layout.medians(values), group_medians(values[:, where], ids, n_groups))


def test_lopsided_group_layout_falls_back_exactly():
    ids = np.array([0] * 300 + list(range(1, 40)))  # padding every group to 300 would dominate
    values = np.random.default_rng(1).random((2, len(ids)))
    layout = GroupLayout(ids, 40)
    assert not layout.padded
    np.testing.assert_array_equal(layout.medians(values), group_medians(values, ids, 40))


def test_group_stats_reuse_members_only_for_the_same_grouping():
    gid = np.array([0, 0, 0, 1, 1, -1])
    ngid = np.array([0, 0, 0, 1, 1, 2])
    levels = np.arange(24, dtype=float).reshape(4, 6)
    fractions = np.zeros((2, 6))
    first = group_stats(gid, ngid, 3, levels, fractions)
    again = group_stats(gid.copy(), ngid.copy(), 3, levels, fractions, first.members)
    assert again.members is first.members
    np.testing.assert_array_equal(again.levels, [[1, 3.5, 5], [7, 9.5, 11], [13, 15.5, 17], [19, 21.5, 23]])
    moved = group_stats(
        np.array([0, 0, 1, 1, 1, -1]), np.array([0, 0, 1, 1, 1, 2]), 3, levels, fractions, first.members
    )
    assert moved.members is not first.members and moved.levels[0, 0] == 0.5
    assert isinstance(moved.members, GroupMembers)


def test_build_reuses_ids_for_unchanged_inputs_and_rebuilds_on_change():
    reg = GroupRegistry()
    slot_job = np.array([0, 0, -1, -1])
    node = np.array([0, 0, 1, 1])
    model = np.zeros(4, dtype=np.int64)
    has, busy = np.ones(4, dtype=bool), np.ones(4, dtype=bool)
    gid, ngid = reg.build(100.0, slot_job, node, model, ["j"], has, busy)
    assert not gid.flags.writeable  # shared across ticks: nobody may edit it
    same, _ = reg.build(105.0, slot_job.copy(), node, model, ["j"], has, busy)
    assert same is gid
    busy[3] = False
    changed, _ = reg.build(110.0, slot_job, node, model, ["j"], has, busy)
    assert changed is not gid and changed[3] == -1 and changed[0] == gid[0]


def test_the_id_of_a_group_gone_for_the_retention_goes_to_the_next_new_group():
    reg = GroupRegistry(retention_seconds=900.0)
    node = np.zeros(2, dtype=np.int64)
    model = np.zeros(2, dtype=np.int64)
    seen = np.ones(2, dtype=bool)
    idle = np.zeros(2, dtype=bool)

    def build(t, jobs, names):
        gid, _ = reg.build(t, np.array(jobs), node, model, names, seen, idle)
        return gid.tolist()

    a, b = build(0.0, [0, 1], ["a", "b"])
    assert reg.recycled == [] and a != b
    build(100.0, [-1, 1], ["a", "b"])  # a has no member from 100 s on
    assert build(900.0, [2, 1], ["a", "b", "c"])[0] != a  # 800 s later: not yet
    build(950.0, [-1, 1], ["a", "b", "c"])  # c leaves too
    ids = len(reg.keys)
    (d, _) = build(1000.0, [3, 1], ["a", "b", "c", "d"])  # 900 s after a left: its id is d's
    assert d == a and reg.recycled == [(a, (JOB, "a"))] and len(reg.keys) == ids
    assert reg.keys[a] == (JOB, "d") and (JOB, "a") not in reg.ids and reg.first_seen[a] == 1000.0
    # A group back before its id was taken keeps it, and its first sighting.
    assert build(1100.0, [-1, 1], ["a", "b", "c", "d"]) == [-1, b]
    assert build(1200.0, [2, 1], ["a", "b", "c", "d"])[0] == reg.ids[(JOB, "c")] and reg.recycled == []
    assert reg.first_seen[reg.ids[(JOB, "c")]] == 900.0


def test_an_inferred_job_absorbing_whole_node_groups_carries_their_learning_and_takes_over_a_history():
    # Two nodes of one unattributed job: first each node's busy GPUs are a node group; once inferred, both
    # node groups went whole into the job, so what their GPUs learned carries over. A GPU whose node group
    # was split (its other GPUs stayed out) carries nothing.
    reg = GroupRegistry()
    slot_job = np.full(6, -1)
    node = np.array([0, 0, 1, 1, 2, 2])
    model = np.zeros(6, dtype=np.int64)
    seen = busy = np.ones(6, dtype=bool)
    before, _ = reg.build(100.0, slot_job, node, model, [], seen, busy)
    assert reg.absorbed == [] and not reg.carried.any()
    labels = np.array([0, 0, 0, 0, 0, -1])
    gid, _ = reg.build(340.0, slot_job, node, model, [], seen, busy, inferred=labels)
    job = int(gid[0])
    assert (gid[:5] == job).all() and reg.one_job[job] and not reg.is_job[job]
    assert reg.carried.tolist() == [True, True, True, True, False, False]
    assert len(reg.absorbed) == 1 and reg.absorbed[0][0] == job
    assert reg.absorbed[0][1] in {int(before[0]), int(before[2])}
    # It ran before it was inferred: first seen when its parts were.
    assert reg.first_seen[job] == 100.0
    # The same membership again changes nothing and carries nothing more.
    reg.build(345.0, slot_job, node, model, [], seen, busy, inferred=labels)
    assert reg.absorbed == [] and not reg.carried.any()
