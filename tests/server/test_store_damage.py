"""A damaged alert store: found at start by SQLite's integrity check wherever the damaged page lies, then
moved aside for a fresh store (the log names the copy) or refused with one line and exit 2; damage the
check cannot see answers /alerts from memory and says so in /healthz, never a 500 or a traceback."""

from __future__ import annotations

import asyncio
import logging
import struct
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpufleet.server.alerts import AlertState
from gpufleet.server.api import create_app
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import main
from gpufleet.server.settings import ServerSettings, load_settings
from gpufleet.server.store import AlertStore, StoreError
from gpufleet.server.store_check import MOVE_ASIDE, REFUSE, damage, open_checked
from tests.agent.running import server_process
from tests.server.live_fakes import StepClock, StubEngine, hot_puller, make_alert

PAGE = 4096  # SQLite's default page size, which the store keeps


def _store(path: Path) -> None:
    """A store of several thousand alerts: its table and indexes span many pages each."""
    store = AlertStore(path)
    store.upsert([make_alert(i, state=AlertState.FIRING if i % 5 == 0 else AlertState.RESOLVED) for i in range(3000)])
    store.remember_target_nodes({f"10.0.0.{i}:9471": f"dgx-{i:02d}" for i in range(50)})
    store.close()


def _page_of(path: Path, place: str) -> tuple[int, int]:
    """(page number, offset in it) of the damage: the file header's fields, or a b-tree page header: the
    schema's (page 1, after the file header), the alerts table's root, one of its leaves (the root's
    right-most child), or an index's root."""
    import sqlite3

    db = sqlite3.connect(path)
    roots = dict(db.execute("SELECT name, rootpage FROM sqlite_master").fetchall())
    db.close()
    if place == "header":
        return 1, 24  # past the 16-byte magic string: page size, counters, schema cookie...
    if place == "schema":
        return 1, 100
    if place == "table":
        return roots["alerts"], 0
    if place == "index":
        return roots["alerts_order"], 0
    root = path.read_bytes()[(roots["alerts"] - 1) * PAGE :][:12]
    assert root[0] == 5, "the alerts table fits one page: no leaf to damage"  # 5: an interior table page
    return struct.unpack(">I", root[8:12])[0], 0


def _damage(path: Path, place: str) -> bytes:
    """Overwrite the b-tree header of one page with garbage, as a bad sector would; returns the file's bytes."""
    page, at = _page_of(path, place)
    data = bytearray(path.read_bytes())
    start = (page - 1) * PAGE + at
    data[start : start + 64] = bytes(range(192, 256))
    path.write_bytes(bytes(data))
    return bytes(data)


PLACES = ["header", "schema", "table", "leaf", "index"]


@pytest.mark.parametrize("place", PLACES)
def test_a_damaged_page_anywhere_is_found_and_the_store_moved_aside_for_a_fresh_one(tmp_path, place, caplog) -> None:
    path = tmp_path / "alerts.db"
    _store(path)
    assert damage(path) is None
    damaged = _damage(path, place)
    problem = damage(path)
    assert problem and "\n" not in problem

    with caplog.at_level(logging.ERROR, logger="gpufleet.server.store_check"):
        store = open_checked(path, on_corruption=MOVE_ASIDE, clock=lambda: 1_800_000_000.0)
    [copy] = tmp_path.glob("alerts.db.damaged-*")
    assert copy.name == "alerts.db.damaged-20270115T080000Z" and copy.read_bytes() == damaged
    [record] = [r for r in caplog.records if r.getMessage() == "alert store damaged: moved aside, starting a fresh one"]
    assert (record.copy, record.path) == (str(copy), str(path))  # type: ignore[attr-defined]
    assert store.open_alerts() == [] and store.target_nodes() == {}
    store.upsert([make_alert(1)])
    assert [a.summary for a in store.open_alerts()] == ["alert 1"] and store.failing == {}
    store.close()
    assert damage(path) is None


@pytest.mark.parametrize("place", PLACES)
def test_refuse_leaves_a_damaged_store_alone_with_one_line(tmp_path, place) -> None:
    path = tmp_path / "alerts.db"
    _store(path)
    damaged = _damage(path, place)
    with pytest.raises(StoreError) as refused:
        open_checked(path, on_corruption=REFUSE)
    message = str(refused.value)
    assert "\n" not in message and "is damaged" in message and "--storage.on-corruption move-aside" in message
    assert path.read_bytes() == damaged and list(tmp_path.glob("*.damaged-*")) == []


def test_serve_refuses_a_damaged_store_with_exit_2_and_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "alerts.db"
    _store(path)
    _damage(path, "table")
    argv = ["--web.listen-address", "127.0.0.1:0", "--targets", "dgx-01:9471"]
    argv += ["--storage.path", str(path), "--storage.on-corruption", REFUSE]
    assert main(argv) == 2
    # Structured log lines (the source's own start-up notes) may come first; the refusal is one plain line.
    plain = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("{")]
    assert len(plain) == 1 and plain[0].startswith("gpufleet-server: alert store") and "is damaged" in plain[0]


def test_the_default_is_move_aside_and_the_flag_takes_only_the_two_answers() -> None:
    assert load_settings([], env={}).storage_on_corruption == MOVE_ASIDE
    assert load_settings(["--storage.on-corruption", "refuse"], env={}).storage_on_corruption == REFUSE
    from gpufleet.server.settings import ConfigError

    with pytest.raises(ConfigError, match="--storage.on-corruption"):
        load_settings(["--storage.on-corruption", "repair"], env={})


def test_a_real_server_on_a_damaged_store_moves_it_aside_and_serves(tmp_path) -> None:
    """The whole start path: the damaged file is moved aside, the server comes up on a fresh store, and its
    API answers (damage the restore reads would otherwise end it with a traceback and exit 3)."""
    path = tmp_path / "server.db"
    _store(path)
    damaged = _damage(path, "leaf")
    with server_process(
        tmp_path, "--targets", "127.0.0.1:1", "--pull.interval", "250ms", "--pull.timeout", "250ms"
    ) as (
        proc,
        port,
    ):
        [copy] = tmp_path.glob("server.db.damaged-*")
        assert copy.read_bytes() == damaged
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
        assert api.get("/alerts").status_code == 200 and api.get("/alerts").json()["total"] == 0
        assert api.get("/").status_code == 200
        assert proc.poll() is None


def test_damage_the_start_check_missed_degrades_healthz_and_alerts_come_from_memory(tmp_path) -> None:
    """The store opened without its check (damage that came later): the restore, every write and every read
    fail, and the server goes on: alerts fire, /alerts and / answer from memory, /healthz says why."""
    path = tmp_path / "alerts.db"
    _store(path)
    _damage(path, "table")
    clock = StepClock(5000.0)
    puller = hot_puller(clock, (95.0, 60.0))
    store = AlertStore(path)
    runtime = Runtime(engine=StubEngine(), source=puller, store=store, clock=clock)
    client = TestClient(create_app(ServerSettings(storage_path=str(path)), runtime=runtime, run_pipeline=False))
    assert runtime.restore() == 0  # unreadable: started without its open alerts, not dead

    asyncio.run(runtime.cycle())  # GPU 0 runs hot: its alert fires, and cannot be written
    [fired] = runtime.view.alerts
    health = client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["degraded_reason"] == "store_unsaved"
    assert "alert store write failed: database disk image is malformed" in health.json()["degraded_detail"]

    listed = client.get("/alerts", params={"state": "firing"})
    assert listed.status_code == 200 and [a["id"] for a in listed.json()["alerts"]] == [fired.id]
    assert client.get("/alerts", params={"node": "dgx-02"}).json()["total"] == 0
    assert client.get(f"/alerts/{fired.id}").json()["id"] == fired.id
    resolved_long_ago = client.get(f"/alerts/{make_alert(1).id}")  # only the store could say
    assert resolved_long_ago.status_code == 503 and "malformed" in resolved_long_ago.json()["detail"]
    assert client.get("/").status_code == 200

    runtime._unsaved.clear()  # nothing waits any more, and the store still fails
    runtime.stats.store_unsaved_changes = 0
    health = client.get("/healthz").json()
    assert (health["status"], health["degraded_reason"]) == ("degraded", "store_error")
    assert "alert store read failed: database disk image is malformed" in health["degraded_detail"]
    store.close()


def test_check_config_names_a_damaged_store_where_serve_would_refuse_it(tmp_path, capsys) -> None:
    from gpufleet.server.cli import main as cli

    path = tmp_path / "alerts.db"
    _store(path)
    assert (
        cli(
            ["check-config", "--targets", "dgx-01:9471", "--storage.path", str(path), "--storage.on-corruption", REFUSE]
        )
        == 0
    )
    capsys.readouterr()
    _damage(path, "index")
    assert (
        cli(["check-config", "--targets", "dgx-01:9471", "--storage.path", str(path)]) == 0
    )  # moved aside at start: not a problem
    capsys.readouterr()
    assert (
        cli(
            ["check-config", "--targets", "dgx-01:9471", "--storage.path", str(path), "--storage.on-corruption", REFUSE]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged" in err and "serve would refuse it" in err
