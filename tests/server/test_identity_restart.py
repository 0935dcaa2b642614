"""A node's name stays with the target it answered from across a restart: another target claiming it while
the real one is merely down is refused, and the real one is taken back when it returns."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings
from tests.server.live_fakes import StubEngine, envelope, parse_dict, snapshot

REAL, IMPOSTOR = "10.0.0.1:9471", "10.0.0.9:9471"


def _runtime(settings: ServerSettings, now: list[float], down: set[str]):
    def handler(request: httpx.Request) -> httpx.Response:
        target = f"{request.url.host}:{request.url.port}"
        if target in down:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", now[0])])))

    return build_runtime(
        settings, engine=StubEngine(), clock=lambda: now[0], transport=httpx.MockTransport(handler), parse=parse_dict
    )


async def _cycles(runtime, now: list[float], n: int) -> None:
    for _ in range(n):
        now[0] += 5
        await runtime.cycle()


def test_an_impostor_cannot_take_a_known_nodes_name_while_its_target_is_down_across_a_restart(tmp_path) -> None:
    now = [1000.0]
    down = {IMPOSTOR}
    settings = ServerSettings(targets=(REAL, IMPOSTOR), storage_path=str(tmp_path / "i.db"))
    first = _runtime(settings, now, down)
    asyncio.run(_cycles(first, now, 2))
    assert first.store.target_nodes() == {REAL: "dgx-01"}
    first.store.close()

    down.clear()
    down.add(REAL)  # the real agent is briefly down when the server restarts; the impostor answers
    second = _runtime(settings, now, down)
    second.restore()
    asyncio.run(_cycles(second, now, 3))
    assert second.engine.samples == []
    assert second.puller.errors == {(IMPOSTOR, "node_claimed"): 3, (REAL, "connect"): 3}
    assert second.store.target_nodes() == {REAL: "dgx-01"}

    down.clear()  # the real agent returns: its name is its own
    asyncio.run(_cycles(second, now, 1))
    assert [s["time"] for s in second.engine.samples] == [now[0]]
    assert {h.target: h.up for h in second.puller.health()} == {REAL: True, IMPOSTOR: False}
    assert second.puller.errors[(IMPOSTOR, "node_claimed")] == 4


def test_a_remembered_target_no_longer_listed_frees_its_nodes_name(tmp_path) -> None:
    now = [1000.0]
    first = _runtime(ServerSettings(targets=(REAL,), storage_path=str(tmp_path / "m.db")), now, set())
    asyncio.run(_cycles(first, now, 1))
    first.store.close()

    # The node moved to a new address and the old one left discovery: the new target may answer for it.
    second = _runtime(ServerSettings(targets=(IMPOSTOR,), storage_path=str(tmp_path / "m.db")), now, set())
    second.restore()
    asyncio.run(_cycles(second, now, 1))
    assert [s["node"] for s in second.engine.samples] == ["dgx-01"] and second.puller.errors == {}
