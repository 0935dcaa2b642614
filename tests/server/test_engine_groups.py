"""Peer groups: vectorised group medians, job groups and the unattributed fallbacks."""

from __future__ import annotations

import numpy as np

from server.engine.groups import (CLUSTER_MODEL, JOB, NODE_MODEL, GroupRegistry, group_mean, group_means,
                                  group_median, group_medians)


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
    values = rng.normal(size=(3, n)).round(1)          # rounding makes ties
    values[rng.random((3, n)) < 0.2] = np.nan
    gid = rng.integers(-1, n_groups - 2, n)            # the last groups stay empty
    med = group_medians(values, gid, n_groups)
    assert med.shape == (3, n_groups)
    for r in range(3):
        np.testing.assert_array_equal(med[r], _slow_median(values[r], gid, n_groups))
        np.testing.assert_array_equal(med[r], group_median(values[r], gid, n_groups))
    assert np.isnan(med[:, -2:]).all()


def test_group_medians_beyond_16_bit_ids_fall_back_exactly():
    rng = np.random.default_rng(5)
    n_groups = 20_000                                  # 2 rows x 20,000 ids > int16
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
