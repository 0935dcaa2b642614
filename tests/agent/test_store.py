"""SnapshotStore: latest publication, since-semantics, retention, thread-safety basics."""

from __future__ import annotations

import threading

import orjson
import pytest

from gpufleet.agent.health import AgentHealth
from gpufleet.agent.store import MIN_RETENTION_SECONDS, Publication, SnapshotStore
from tests.agent.fakes import snapshot

HEALTH = AgentHealth(node="dgx-017", version="0.1.0", nvml_up=True)


def pub(t: float | None) -> Publication:
    snap = snapshot(n=1, time=t) if t is not None else None
    body = orjson.dumps(snap.to_dict()) if snap else None
    return Publication(snap, HEALTH, b"metrics", body)


def times(bodies: list[bytes]) -> list[float]:
    return [orjson.loads(b)["time"] for b in bodies]


def test_empty_store_has_nothing():
    store = SnapshotStore()
    assert store.latest() is None
    assert store.since(None) == []
    assert len(store) == 0


def test_since_returns_strictly_newer_oldest_first():
    store = SnapshotStore()
    for t in (100.0, 101.0, 102.0, 103.0):
        store.publish(pub(t))
    assert times(store.since(None)) == [100.0, 101.0, 102.0, 103.0]
    assert times(store.since(101.0)) == [102.0, 103.0]
    assert times(store.since(101.5)) == [102.0, 103.0]
    assert store.since(103.0) == []
    assert times(store.since(-1e12)) == [100.0, 101.0, 102.0, 103.0]
    assert store.latest().snapshot.time == 103.0


def test_retention_drops_old_snapshots_but_keeps_the_window():
    store = SnapshotStore(retention_seconds=120)
    for t in range(0, 301):
        store.publish(pub(float(t)))
    kept = times(store.since(None))
    assert kept[0] == 180.0 and kept[-1] == 300.0
    assert len(kept) == 121


@pytest.mark.parametrize("bad", [0, 60, 119.9, float("nan")])
def test_retention_below_minimum_is_refused(bad):
    with pytest.raises(ValueError, match="at least"):
        SnapshotStore(retention_seconds=bad)
    assert MIN_RETENTION_SECONDS == 120.0


def test_health_only_publication_updates_latest_without_buffering():
    store = SnapshotStore()
    store.publish(pub(100.0))
    first = store.latest()
    down = Publication(
        first.snapshot, AgentHealth(node="dgx-017", version="0.1.0", nvml_up=False), b"down", first.snapshot_json
    )
    store.publish(down)
    store.publish(pub(None))
    assert store.latest().metrics == b"metrics" and store.latest().snapshot is None
    assert len(store) == 1


def test_clock_stepping_back_restarts_the_ring():
    store = SnapshotStore()
    store.publish(pub(200.0))
    store.publish(pub(100.0))
    assert times(store.since(None)) == [100.0]


def test_concurrent_publish_and_read_stay_consistent():
    store = SnapshotStore(retention_seconds=120)
    errors: list[BaseException] = []
    done = threading.Event()

    def reader():
        try:
            while not done.is_set():
                seen = times(store.since(None))
                assert seen == sorted(seen)
                assert not seen or seen[-1] - seen[0] <= 120
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    for t in range(2000):
        store.publish(pub(float(t)))
    done.set()
    for th in threads:
        th.join(timeout=10)
    assert not errors
    assert times(store.since(None))[-1] == 1999.0


def test_a_ring_kept_through_an_nvml_outage_ages_out_by_the_clock():
    # NVML down: the sampler republishes its last snapshot (or none); the ring must still age by the clock.
    now = [100.0]
    store = SnapshotStore(120.0, clock=lambda: now[0])
    for t in (100.0, 101.0, 102.0):
        now[0] = t
        store.publish(pub(t))
    last = store.latest()
    now[0] = 221.5
    store.publish(Publication(last.snapshot, HEALTH, b"metrics", last.snapshot_json))  # unchanged snapshot
    assert times(store.since(None)) == [102.0]
    now[0] = 400.0
    store.publish(Publication(None, HEALTH, b"metrics", None))
    assert len(store) == 0 and store.since(None) == []


def test_a_read_never_serves_snapshots_older_than_retention_before_now():
    store = SnapshotStore(120.0)
    for t in (100.0, 101.0, 102.0):
        store.publish(pub(t))
    assert times(store.since(None, now=221.5)) == [102.0]
    assert store.since(50.0, now=10_000.0) == [] and len(store) == 0


def test_the_store_clock_bounds_reads_without_a_publish():
    now = [100.0]
    store = SnapshotStore(120.0, clock=lambda: now[0])
    store.publish(pub(100.0))
    now[0] = 220.0
    assert times(store.since(None)) == [100.0]
    now[0] = 220.5
    assert store.since(None) == []
