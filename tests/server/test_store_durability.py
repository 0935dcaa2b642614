"""A failed alert-store write (a full disk) is kept and retried every cycle until the store takes it."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace

from fastapi.testclient import TestClient

from gpufleet.server.api import create_app
from gpufleet.server.runtime import Runtime
from gpufleet.server.settings import ServerSettings
from gpufleet.server.store import AlertStore
from gpufleet.server.alerts import AlertState
from tests.server.live_fakes import StepClock, StubEngine, hot_puller, make_alert


class FullDiskStore(AlertStore):
    """SQLite whose writes raise what a full disk raises, while `full` is set."""

    full = False

    def upsert(self, alerts):
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        return super().upsert(alerts)

    def remember_target_nodes(self, nodes):
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        return super().remember_target_nodes(nodes)

    def remember_node_pins(self, pins):
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        return super().remember_node_pins(pins)


def _build(tmp_path, clock, engine=None):
    settings = ServerSettings(storage_path=str(tmp_path / "alerts.db"))
    puller = hot_puller(clock, (95.0, 91.0))
    store = FullDiskStore(settings.storage_path)
    runtime = Runtime(engine=engine or StubEngine(), source=puller, store=store, clock=clock)
    return runtime, store, TestClient(create_app(settings, runtime=runtime, run_pipeline=False))


def _metric(client: TestClient, name: str) -> float | None:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_alerts_that_fired_while_the_disk_was_full_are_written_once_it_has_room(tmp_path):
    clock = StepClock(5000.0)
    runtime, store, client = _build(tmp_path, clock)
    store.full = True
    asyncio.run(runtime.cycle())  # two GPUs start throttling: two alerts fire
    assert [a.state.value for a in runtime.view.alerts] == ["firing", "firing"]
    assert client.get("/alerts").json()["total"] == 0  # nothing reached the store
    clock.now = 5030.0
    asyncio.run(runtime.cycle())  # still full: retried, still waiting
    health = client.get("/healthz")
    # Degraded, but 200: a liveness probe must not restart a server that would lose what waits.
    assert health.status_code == 200 and health.json()["degraded_reason"] == "store_unsaved"
    # 2 alerts, 1 node name, its pin
    assert health.json()["status"] == "degraded" and health.json()["store_unsaved_changes"] == 4
    assert health.json()["store_unsaved_age_seconds"] == 30.0
    assert _metric(client, "gpufleet_server_store_unsaved_changes") == 4
    assert _metric(client, "gpufleet_server_store_unsaved_age_seconds") == 30.0
    assert _metric(client, "gpufleet_server_store_errors_total") == 2

    store.full = False  # space returns; no new transition this cycle
    clock.now = 5035.0
    asyncio.run(runtime.cycle())
    firing = client.get("/alerts", params={"state": "firing"}).json()
    assert firing["total"] == 2
    assert client.get("/healthz").json()["status"] == "ok"
    assert _metric(client, "gpufleet_server_store_unsaved_changes") == 0
    assert _metric(client, "gpufleet_server_store_unsaved_age_seconds") is None
    assert store.target_nodes() == {"a:1": "dgx-01"} and store.node_pins()["dgx-01"].target == "a:1"
    store.close()

    engine = StubEngine()  # and a restart restores both
    runtime2, _, _ = _build(tmp_path, clock, engine=engine)
    assert runtime2.restore() == 2
    assert sorted(a.id for a in engine.restored) == sorted(a["id"] for a in firing["alerts"])


def test_the_newest_state_of_an_alert_is_what_the_store_gets_after_an_outage(tmp_path):
    clock = StepClock(5000.0)
    runtime, store, client = _build(tmp_path, clock)
    store.full = True
    asyncio.run(runtime.cycle())
    (first, _) = runtime.view.alerts
    runtime.engine._latest[("dgx-01", 0)] = (5040.0, 60.0, "j1")  # GPU 0 cools: its alert resolves
    clock.now = 5045.0
    asyncio.run(runtime.cycle())
    store.full = False
    asyncio.run(runtime.cycle())
    assert store.get(first.id).state.value == "resolved"
    assert [a.node for a in store.open_alerts()] == ["dgx-01"]


def test_stopping_while_writes_wait_makes_one_last_try(tmp_path):
    clock = StepClock(5000.0)
    runtime, store, _ = _build(tmp_path, clock)
    store.full = True
    asyncio.run(runtime.cycle())
    store.full = False

    async def stop():
        await runtime.stop()

    asyncio.run(stop())
    reopened = AlertStore(tmp_path / "alerts.db")
    assert len(reopened.open_alerts()) == 2


def test_alerts_a_full_disk_kept_out_of_the_file_are_listed_by_alerts_meanwhile(tmp_path):
    """SQLite's own full-disk error (the file may not grow): /alerts, each alert's page and the restore list
    show the alerts the write could not save, from memory, until the retried write takes them."""
    clock = StepClock(5000.0)
    settings = ServerSettings(storage_path=str(tmp_path / "alerts.db"))
    puller = hot_puller(clock, (95.0, 91.0))
    store = AlertStore(settings.storage_path)
    _fill(store)
    runtime = Runtime(engine=StubEngine(), source=puller, store=store, clock=clock)
    client = TestClient(create_app(settings, runtime=runtime, run_pipeline=False))

    asyncio.run(runtime.cycle())
    assert runtime.stats.store_errors_total >= 1
    listed = client.get("/alerts", params={"state": "firing"}).json()
    assert listed["total"] == 2
    (first, _) = listed["alerts"]
    assert client.get(f"/alerts/{first['id']}").json()["id"] == first["id"]
    assert len(store.open_alerts()) == 2

    store._db.execute("PRAGMA max_page_count = 1073741823")  # room again
    clock.now = 5005.0
    asyncio.run(runtime.cycle())
    assert runtime.stats.store_unsaved_since is None
    assert store._unsaved == 0
    assert client.get("/alerts", params={"state": "firing"}).json()["total"] == 2
    store.close()
    reopened = AlertStore(settings.storage_path)
    assert len(reopened.open_alerts()) == 2
    reopened.close()


def _fill(store: AlertStore) -> None:
    """Let the file grow no further, then fill it with resolved alerts until SQLite says the disk is full."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 4}")
    filler = make_alert(0, state=AlertState.RESOLVED)
    n = 0
    for pad in (1000, 100, 1):  # big rows fill the pages, then small ones their last gaps
        while True:
            n += 1
            try:
                store.upsert([replace(filler, id=f"filler-{n}", evidence={"pad": "x" * pad})])
            except sqlite3.OperationalError as exc:
                assert "full" in str(exc)
                break
            assert n < 10_000, "the file never filled up"
    store._db.execute("DELETE FROM unsaved.alerts")
    store._unsaved = 0
