"""A node's name stays with the target it answered from and the GPUs it reported, across a restart: another
target claiming it while the real one is merely down is refused unless it reports the node's GPUs (the same
agent at a new address), and the real one is taken back when it returns. A pin lapses after its TTL."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from typing import Callable

import httpx
import orjson
import pytest

from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import ServerSettings
from tests.agent.running import server_process
from tests.loopback import answer_json, serving
from tests.server.live_fakes import StubEngine, envelope, parse_dict, snapshot

REAL, IMPOSTOR = "10.0.0.1:9471", "10.0.0.9:9471"
MOVED = "10.0.0.5:9471"  # the real agent at a new address (a new pod IP)


def _answer(node: str, t: float, gpus: str) -> bytes:
    """One snapshot of `node` whose GPU uuids are named after `gpus` (the hardware answering)."""
    snap = snapshot(node, t)
    for gpu in snap["gpus"]:
        gpu["uuid"] = f"GPU-{gpus}-{gpu['index']}"
    return orjson.dumps(envelope(node, [snap]))


def _runtime(settings: ServerSettings, now: list[float], down: set[str], gpus: dict[str, str] | None = None):
    """Every target answers as dgx-01: the impostor with its own GPUs, any other target with the real ones
    unless `gpus` says which hardware answers there."""

    def handler(request: httpx.Request) -> httpx.Response:
        target = f"{request.url.host}:{request.url.port}"
        if target in down:
            raise httpx.ConnectError("refused")
        hardware = (gpus or {}).get(target, "impostor" if target == IMPOSTOR else "real")
        return httpx.Response(200, content=_answer("dgx-01", now[0], hardware))

    return build_runtime(
        settings, engine=StubEngine(), clock=lambda: now[0], transport=httpx.MockTransport(handler), parse=parse_dict
    )


async def _cycles(runtime, now: list[float], n: int) -> None:
    for _ in range(n):
        now[0] += 5
        await runtime.cycle()


def _pinned_by_the_real_agent(path: str, now: list[float], cycles: int) -> None:
    """A server that pulled the real agent `cycles` times and stopped: the store at `path` holds its pin."""
    first = _runtime(ServerSettings(targets=(REAL,), storage_path=path), now, set())
    asyncio.run(_cycles(first, now, cycles))
    first.store.close()


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
    assert second.source.errors == {(IMPOSTOR, "node_claimed"): 3, (REAL, "connect"): 3}
    assert second.store.target_nodes() == {REAL: "dgx-01"}

    down.clear()  # the real agent returns: its name is its own
    asyncio.run(_cycles(second, now, 1))
    assert [s["time"] for s in second.engine.samples] == [now[0]]
    assert {h.target: h.up for h in second.source.health()} == {REAL: True, IMPOSTOR: False}
    assert second.source.errors[(IMPOSTOR, "node_claimed")] == 4


def test_a_remembered_target_no_longer_listed_frees_its_nodes_name(tmp_path) -> None:
    now = [1000.0]
    _pinned_by_the_real_agent(str(tmp_path / "m.db"), now, 1)

    # The node moved to a new address and the old one left discovery: the new target may answer for it.
    second = _runtime(ServerSettings(targets=(MOVED,), storage_path=str(tmp_path / "m.db")), now, set())
    second.restore()
    asyncio.run(_cycles(second, now, 1))
    assert [s["node"] for s in second.engine.samples] == ["dgx-01"] and second.source.errors == {}


def test_the_real_agent_back_at_a_new_address_with_its_gpus_takes_its_name_across_a_restart(tmp_path) -> None:
    now = [1000.0]
    path = str(tmp_path / "n.db")
    _pinned_by_the_real_agent(path, now, 2)

    # The pod restarted under a new IP while the server restarted, and discovery still lists the old one.
    down = {REAL}
    second = _runtime(ServerSettings(targets=(REAL, MOVED), storage_path=path), now, down)
    second.restore()
    asyncio.run(_cycles(second, now, 1))
    assert [s["time"] for s in second.engine.samples] == [now[0]]
    assert {h.target: h.up for h in second.source.health()} == {REAL: False, MOVED: True}
    assert second.store.node_pins()["dgx-01"].target == MOVED

    down.clear()
    down.add(MOVED)  # and back at its old address, with the same GPUs
    asyncio.run(_cycles(second, now, 1))
    assert second.engine.samples[-1]["time"] == now[0]
    assert {h.target: h.up for h in second.source.health()} == {REAL: True, MOVED: False}
    assert second.source.errors == {(REAL, "connect"): 1, (MOVED, "connect"): 1}


def test_an_impostor_with_other_gpus_is_refused_across_restarts_after_the_nodes_address_left(tmp_path) -> None:
    now = [1000.0]
    path = str(tmp_path / "o.db")
    _pinned_by_the_real_agent(path, now, 1)
    for _ in range(2):  # each restart reads the pin back from the store
        runtime = _runtime(ServerSettings(targets=(IMPOSTOR,), storage_path=path), now, set())
        runtime.restore()
        asyncio.run(_cycles(runtime, now, 2))
        assert runtime.engine.samples == [] and runtime.source.errors == {(IMPOSTOR, "node_claimed"): 2}
        assert "none of them" in (runtime.source.health()[0].last_error or "")
        runtime.store.close()


def test_after_the_identity_ttl_a_node_with_replaced_gpus_takes_its_name_across_a_restart(tmp_path, caplog) -> None:
    now = [1000.0]
    settings = ServerSettings(targets=(REAL,), storage_path=str(tmp_path / "t.db"), targets_identity_ttl_seconds=3600)
    first = _runtime(settings, now, set())
    asyncio.run(_cycles(first, now, 2))
    last_served = now[0]
    first.store.close()

    # The node's GPUs were replaced, and its agent answers from a new address; the old one is still listed.
    settings = replace(settings, targets=(REAL, MOVED))
    second = _runtime(settings, now, {REAL}, gpus={MOVED: "replaced"})
    second.restore()
    asyncio.run(_cycles(second, now, 1))
    assert second.engine.samples == [] and second.source.errors[(MOVED, "node_claimed")] == 1
    now[0] = last_served + 3600  # the next cycle is 5 s past the TTL
    with caplog.at_level(logging.INFO, logger="gpufleet.server.ingest.identity"):
        asyncio.run(_cycles(second, now, 1))
    assert "no longer pinned" in caplog.text
    assert [s["time"] for s in second.engine.samples] == [now[0]]
    pin = second.store.node_pins()["dgx-01"]
    assert (pin.target, pin.gpu_uuids) == (MOVED, {"GPU-replaced-0", "GPU-replaced-1"})


class _Agent(BaseHTTPRequestHandler):
    """Answers /snapshots as dgx-01 with one fresh snapshot; `gpu_tag` tells the real agent's GPUs apart."""

    gpu_tag = "real"

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        snap = snapshot("dgx-01", time.time())
        for gpu in snap["gpus"]:
            gpu["uuid"] = f"GPU-{self.gpu_tag}-{gpu['index']}"
        body = orjson.dumps({**envelope("dgx-01", [snap]), "time": time.time()})
        answer_json(self, body)

    def log_message(self, *_: object) -> None:
        pass


class _Impostor(_Agent):
    gpu_tag = "impostor"


def _metric(api: httpx.Client, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in api.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and line.split("}")[0].split("{")[1].split(",") == want.split(","):
            return float(line.rsplit(" ", 1)[1])
    return None


def _until(what: str, check: Callable[[], bool], proc) -> None:
    waiter = threading.Event()
    for _ in range(120):
        assert proc.poll() is None, f"the server ended while waiting for: {what}"
        if check():
            return
        waiter.wait(0.25)
    pytest.fail(f"never within 30 s: {what}")


def _until_refused(api: httpx.Client, impostor: str, proc) -> None:
    """Waits until the server has refused `impostor` three times for claiming a pinned node, and checks it
    counts the impostor down."""
    _until(
        "the impostor refused three times",
        lambda: (_metric(api, "gpufleet_server_pull_errors_total", target=impostor, reason="node_claimed") or 0) >= 3,
        proc,
    )
    assert _metric(api, "gpufleet_server_target_up", target=impostor) == 0.0


def test_real_servers_keep_a_node_name_with_its_target_across_a_restart(tmp_path) -> None:
    """Real `serve` processes on one store: the real agent is down when the server restarts and an impostor
    claims its name; the impostor is refused, and the real agent, back on its address, is taken."""
    with serving(_Agent) as real_port:
        with serving(_Impostor) as impostor_port:
            real, impostor = f"127.0.0.1:{real_port}", f"127.0.0.1:{impostor_port}"
            timing = ("--pull.interval", "250ms", "--pull.timeout", "250ms")
            with server_process(tmp_path, "--targets", real, *timing) as (proc, port):
                api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
                _until(
                    "the real agent pulled", lambda: _metric(api, "gpufleet_server_target_up", target=real) == 1.0, proc
                )
                _until("its node name stored", lambda: api.get("/healthz").json()["cycles"] >= 3, proc)
            # The real agent goes down (its port closes) and the server restarts meanwhile.
    with serving(_Impostor, impostor_port):
        with server_process(tmp_path, "--targets", f"{real},{impostor}", *timing) as (proc, port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            _until_refused(api, impostor, proc)
            assert [n["node"] for n in api.get("/nodes").json()["nodes"]] == []
            with serving(_Agent, real_port):  # the real agent is back on its address
                _until(
                    "the real agent taken back",
                    lambda: _metric(api, "gpufleet_server_target_up", target=real) == 1.0,
                    proc,
                )
                assert _metric(api, "gpufleet_server_target_up", target=impostor) == 0.0
                nodes = api.get("/nodes").json()["nodes"]
                assert [n["node"] for n in nodes] == ["dgx-01"]


def test_real_servers_give_a_node_name_to_its_agent_at_a_new_address_and_not_to_other_gpus(tmp_path) -> None:
    """Real `serve` processes on one store, agents found through a file_sd file: the agent comes back under a
    new address (its old one still listed) while the server restarts, beside an impostor with other GPUs.
    The agent at its new address takes its name; the impostor is refused."""
    sd = tmp_path / "agents.json"
    timing = ("--pull.interval", "250ms", "--pull.timeout", "250ms")
    with serving(_Agent) as old_port:
        old = f"127.0.0.1:{old_port}"
        sd.write_text(orjson.dumps([{"targets": [old]}]).decode())
        with server_process(tmp_path, "--targets.file-sd", str(sd), *timing) as (proc, port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            _until("the agent pulled", lambda: _metric(api, "gpufleet_server_target_up", target=old) == 1.0, proc)
            _until("its pin stored", lambda: api.get("/healthz").json()["cycles"] >= 3, proc)
    with serving(_Agent) as new_port, serving(_Impostor) as impostor_port:
        new, impostor = f"127.0.0.1:{new_port}", f"127.0.0.1:{impostor_port}"
        sd.write_text(orjson.dumps([{"targets": [old, impostor, new]}]).decode())
        with server_process(tmp_path, "--targets.file-sd", str(sd), *timing) as (proc, port):
            api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            _until(
                "the agent taken at its new address",
                lambda: _metric(api, "gpufleet_server_target_up", target=new) == 1.0,
                proc,
            )
            _until_refused(api, impostor, proc)
            assert [n["node"] for n in api.get("/nodes").json()["nodes"]] == ["dgx-01"]
