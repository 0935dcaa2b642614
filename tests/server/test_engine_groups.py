"""Peer groups: vectorised group medians, job groups and the unattributed fallbacks."""

from __future__ import annotations

import numpy as np

from server.engine.groups import CLUSTER_MODEL, JOB, NODE_MODEL, GroupRegistry, group_median


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
