"""The SQLite alert store: upserts, restore set, filtered pagination, retention."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest

from gpufleet.server.alerts import AlertKind, AlertState, Severity
from gpufleet.server.ingest.identity import NodePin
from gpufleet.server.store import MAX_PAGE, AlertQuery, AlertStore, StoreError
from tests.server.live_fakes import make_alert


@pytest.fixture
def store(tmp_path):
    s = AlertStore(tmp_path / "alerts.db")
    yield s
    s.close()


def test_upsert_keeps_latest_state_and_roundtrips_every_field(store) -> None:
    alert = make_alert(1, gpu=5)
    store.upsert([alert])
    resolved = replace(
        alert,
        state=AlertState.RESOLVED,
        resolved=2000.0,
        updated=2000.0,
        evidence={"nested": {"a": [1, 2]}, "ratio": 0.25, "none": None},
    )
    store.upsert([resolved])
    assert store.get(alert.id) == resolved
    assert store.query(AlertQuery()).total == 1
    assert store.get("nope") is None


def test_open_alerts_are_pending_and_firing_only(store) -> None:
    store.upsert([make_alert(1, state=AlertState.PENDING), make_alert(2), make_alert(3, state=AlertState.RESOLVED)])
    assert [a.summary for a in store.open_alerts()] == ["alert 1", "alert 2"]


def test_persistence_across_reopen(tmp_path) -> None:
    path = tmp_path / "a.db"
    first = AlertStore(path)
    first.upsert([make_alert(i) for i in range(3)])
    first.close()
    second = AlertStore(path)
    assert len(second.open_alerts()) == 3
    assert second._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    second.close()


def test_filters_combine(store) -> None:
    store.upsert(
        [
            make_alert(1, kind=AlertKind.THERMAL_THROTTLE, severity=Severity.CRITICAL, node="dgx-03", gpu=5),
            make_alert(2, kind=AlertKind.STRAGGLER, node="dgx-03", gpu=5, hpc_job="7"),
            make_alert(3, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job="7", state=AlertState.RESOLVED),
            make_alert(4, kind=AlertKind.STRAGGLER, node="dgx-01", gpu=0, hpc_job="8", state=AlertState.PENDING),
        ]
    )

    def ids(**kw):
        return [a.summary for a in store.query(AlertQuery(**kw)).alerts]

    assert ids() == ["alert 4", "alert 3", "alert 2", "alert 1"]
    assert ids(kind=AlertKind.STRAGGLER) == ["alert 4", "alert 2"]
    assert ids(node="dgx-03", gpu=5) == ["alert 2", "alert 1"]
    assert ids(severity=Severity.CRITICAL) == ["alert 1"]
    assert ids(hpc_job="7", state=AlertState.RESOLVED) == ["alert 3"]
    assert ids(gpu=0) == ["alert 4"]
    # alert 3 resolved at 1000 + 3 + 50 = 1053
    assert ids(since=1053.0) == ["alert 4", "alert 3", "alert 2", "alert 1"]
    assert ids(since=1053.5) == ["alert 4", "alert 2", "alert 1"]


def test_pagination_is_stable_and_capped(store) -> None:
    store.upsert([make_alert(i) for i in range(25)])
    pages = [store.query(AlertQuery(limit=10, offset=o)) for o in (0, 10, 20)]
    seen = [a.id for p in pages for a in p.alerts]
    assert len(seen) == 25 == len(set(seen)) and all(p.total == 25 for p in pages)
    assert [len(p.alerts) for p in pages] == [10, 10, 5]
    assert len(store.query(AlertQuery(limit=MAX_PAGE + 500)).alerts) == 25


def test_prune_by_age_and_by_count(tmp_path) -> None:
    store = AlertStore(tmp_path / "p.db", retention_seconds=100, max_resolved=2)
    store.upsert([make_alert(i, state=AlertState.RESOLVED, t=1000.0) for i in range(5)])  # resolved 1050..1054
    store.upsert([make_alert(99, t=0.0)])  # firing: never pruned
    assert store.prune(now=1152.5) == 3  # 1050,1051,1052 too old
    remaining = {a.summary for a in store.query(AlertQuery()).alerts}
    assert remaining == {"alert 3", "alert 4", "alert 99"}
    store.upsert([make_alert(i, state=AlertState.RESOLVED, t=1100.0) for i in range(10, 13)])
    store.prune(now=1160.0)
    resolved = store.query(AlertQuery(state=AlertState.RESOLVED)).alerts
    assert len(resolved) == 2 and store.query(AlertQuery(state=AlertState.FIRING)).total == 1
    store.close()


def test_unopenable_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(StoreError, match="cannot open alert store"):
        AlertStore(tmp_path / "missing-dir" / "x.db")
    not_db = tmp_path / "junk.db"
    not_db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises((StoreError, sqlite3.DatabaseError)):
        AlertStore(not_db)


def test_target_node_names_survive_a_reopen(tmp_path) -> None:
    path = tmp_path / "t.db"
    first = AlertStore(path)
    assert first.target_nodes() == {}
    first.remember_target_nodes({"10.0.0.1:9471": "dgx-01", "10.0.0.2:9471": "dgx-02"})
    first.remember_target_nodes({"10.0.0.2:9471": "dgx-22"})
    first.remember_target_nodes({})
    first.close()
    second = AlertStore(path)
    assert second.target_nodes() == {"10.0.0.1:9471": "dgx-01", "10.0.0.2:9471": "dgx-22"}
    second.close()


def test_node_pins_survive_a_reopen_and_a_lapsed_one_is_deleted(tmp_path) -> None:
    path = tmp_path / "p.db"
    first = AlertStore(path)
    assert first.node_pins() == {}
    first.remember_node_pins(
        {
            "dgx-01": NodePin("10.0.0.1:9471", frozenset({"GPU-a0", "GPU-a1"}), 1000.0),
            "cpu-01": NodePin("c:1", frozenset(), 5.0),
        }
    )
    first.remember_node_pins({"cpu-01": None, "dgx-02": NodePin("b:1", frozenset({"GPU-b0"}), 2000.0)})
    first.close()
    second = AlertStore(path)
    assert second.node_pins() == {
        "dgx-01": NodePin("10.0.0.1:9471", frozenset({"GPU-a0", "GPU-a1"}), 1000.0),
        "dgx-02": NodePin("b:1", frozenset({"GPU-b0"}), 2000.0),
    }
    second.close()
