"""A restart keeps every open alert's id and start, and sends no resolve for it: engine alerts and the
ingest side's node_unreachable (a target down, or answering with nothing usable) alike."""

from __future__ import annotations

import asyncio
import signal
import threading
from http.server import BaseHTTPRequestHandler
from typing import Callable

import httpx
import orjson
import pytest

from gpufleet.server.alerts import AlertState
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings
from tests.agent.running import server_process
from tests.loopback import answer_json, serving
from tests.server.live_fakes import StubEngine, envelope, parse_dict, snapshot

HOSTS = {"10.0.0.1": "dgx-01", "10.0.0.2": "dgx-02", "10.0.0.3": "dgx-03"}


def _agents(now: list[float], broken: set[str]) -> Callable[[httpx.Request], httpx.Response]:
    """dgx-01 runs one GPU hot (the engine's alert), dgx-02 is down, dgx-03 answers with snapshots that every
    check rejects (no GPU list): the ingest side's two kinds of node_unreachable."""

    def handler(request: httpx.Request) -> httpx.Response:
        node = HOSTS[request.url.host]
        if node == "dgx-02":
            raise httpx.ConnectError("refused")
        snap = snapshot(node, now[0], temps=(60.0, 95.0))
        if node in broken:
            del snap["gpus"]
        return httpx.Response(200, content=orjson.dumps(envelope(node, [snap])))

    return handler


def _runtime(settings: ServerSettings, now: list[float], engine: StubEngine, broken: set[str] | None = None):
    handler = _agents(now, {"dgx-03"} if broken is None else broken)
    return build_runtime(
        settings, engine=engine, clock=lambda: now[0], transport=httpx.MockTransport(handler), parse=parse_dict
    )


async def _cycles(runtime, now: list[float], n: int) -> list:
    out = []
    for _ in range(n):
        now[0] += 5
        out += await runtime.cycle()
    return out


def test_every_open_alert_keeps_its_id_and_start_across_a_restart_and_nothing_resolves(tmp_path) -> None:
    now = [1000.0]
    settings = ServerSettings(
        targets=tuple(f"{h}:9471" for h in HOSTS), storage_path=str(tmp_path / "r.db"), pull_stale_after_seconds=30
    )
    first = _runtime(settings, now, StubEngine())
    asyncio.run(_cycles(first, now, 10))
    before = {(a.kind.value, a.node, a.evidence.get("reason")): (a.id, a.started) for a in first.store.open_alerts()}
    assert set(before) == {
        ("thermal_throttle", "dgx-01", None),
        ("node_unreachable", "10.0.0.2:9471", "down"),
        ("node_unreachable", "dgx-03", "stale"),
    }
    first.store.close()  # as a SIGKILL leaves it: every cycle's changes are already written

    now[0] += 10
    second = _runtime(settings, now, StubEngine())
    assert second.restore() == 3
    # Past the stale-after (30 s) and the down threshold: the first answer after a restart reads as new data,
    # and a restored alert resolved on it would fire again under a new id once the target read stale.
    transitions = asyncio.run(_cycles(second, now, 12))
    assert [(t.alert.kind.value, t.alert.node, t.alert.state.value) for t in transitions] == []
    after = {(a.kind.value, a.node, a.evidence.get("reason")): (a.id, a.started) for a in second.store.open_alerts()}
    assert after == before
    assert {a.id for a in second.view.alerts} == {i for i, _ in before.values()}


def test_a_restored_stale_alert_resolves_once_its_target_delivers_again(tmp_path) -> None:
    now = [1000.0]
    broken = {"dgx-03"}
    settings = ServerSettings(
        targets=("10.0.0.3:9471",), storage_path=str(tmp_path / "s.db"), pull_stale_after_seconds=30
    )
    first = _runtime(settings, now, StubEngine(), broken)
    asyncio.run(_cycles(first, now, 10))
    [stale] = first.store.open_alerts()
    first.store.close()

    second = _runtime(settings, now, StubEngine(), broken)
    second.restore()
    assert asyncio.run(_cycles(second, now, 2)) == []
    broken.clear()  # the agent is fixed: its samples reach the engine
    [resolved] = [t for t in asyncio.run(_cycles(second, now, 1)) if t.alert.kind.value == "node_unreachable"]
    assert (resolved.alert.id, resolved.alert.state) == (stale.id, AlertState.RESOLVED)
    assert [a.kind.value for a in second.store.open_alerts()] == ["thermal_throttle"]  # its hot GPU, now seen


class _BrokenAgent(BaseHTTPRequestHandler):
    """An agent that answers every /snapshots with a snapshot the contract rejects (no GPU list)."""

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        import time

        body = orjson.dumps(envelope("dgx-03", [{"schema": 1, "node": "dgx-03", "time": time.time()}]))
        answer_json(self, body)

    def log_message(self, *_: object) -> None:
        pass


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(what: str, check: Callable[[], bool], proc) -> None:
    waiter = threading.Event()
    for _ in range(120):
        assert proc.poll() is None, f"the server ended while waiting for: {what}"
        if check():
            return
        waiter.wait(0.25)
    pytest.fail(f"never within 30 s: {what}")


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_real_server_restarted_keeps_its_ingest_alerts_and_resolves_none(tmp_path, stop) -> None:
    """Real `serve` processes on one store: a target down and a target whose every snapshot is rejected each
    raise node_unreachable; killed (or stopped) and started again, the server carries both on under the
    same id and start, through its stale-after, with no resolve in between."""
    with serving(_BrokenAgent) as port:
        flags = (
            "--targets",
            f"127.0.0.1:{port},127.0.0.1:{_closed_port()}",
            "--pull.interval",
            "250ms",
            "--pull.timeout",
            "250ms",
            "--pull.stale-after",
            "1s",
        )

        def firing(api: httpx.Client) -> dict:
            alerts = api.get("/alerts", params={"state": "firing"}).json()["alerts"]
            return {a["evidence"]["reason"]: (a["id"], a["started"]) for a in alerts}

        with server_process(tmp_path, *flags) as (proc, api_port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=10)
            _until("both ingest alerts fire", lambda: set(firing(api)) == {"down", "stale"}, proc)
            before = firing(api)
            proc.send_signal(stop)
            proc.wait(timeout=30)
        with server_process(tmp_path, *flags) as (proc, api_port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=10)
            # 12 cycles of 250 ms: three times the stale-after, in which a first answer read as fresh data
            # would have resolved the stale one and fired it again.
            _until("12 cycles after the restart", lambda: api.get("/healthz").json()["cycles"] >= 12, proc)
            assert firing(api) == before
            every = api.get("/alerts").json()
            assert every["total"] == 2 and {a["state"] for a in every["alerts"]} == {"firing"}
