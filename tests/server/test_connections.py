"""The API's connections are bounded: idle sockets that never send a request cannot exhaust the server's
file descriptors, and a failing accept() is logged once per interval, not on every retry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import socket

import httpx
import pytest

from gpufleet.server.connections import AnswerLimit, OncePerInterval, is_accept_error
from gpufleet.server.settings import ConfigError, load_settings
from tests.agent.running import server_process

IDLE_SOCKETS = 150
FILE_LIMIT = 64  # the server's open-file limit, lowered in its process: half is its connection budget


def accept_error() -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource", (), None)


def test_accept_errors_are_logged_once_per_interval_with_the_count_held_back() -> None:
    now = [0.0]
    flt = OncePerInterval(is_accept_error, interval_seconds=10.0, clock=lambda: now[0])
    passed = []
    for i in range(1000):  # 1000 retries over 25 s
        now[0] = i * 0.025
        record = accept_error()
        if flt.filter(record):
            passed.append((now[0], record.repeated))
    assert passed == [(0.0, 0), (10.0, 399), (20.0, 399)]
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", (), None)
    assert flt.filter(other)  # other asyncio records pass untouched


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed the socket (within the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_cannot_take_the_api_down(tmp_path) -> None:
    with server_process(tmp_path, "--targets", "127.0.0.1:1", "--web.read-header-timeout", "2s") as (proc, port):
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))
        with contextlib.ExitStack() as stack:
            idle = [
                stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
                for _ in range(IDLE_SOCKETS)
            ]
            idle[-1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a request head that never ends
            # More idle sockets than the server has descriptors for, and still it answers.
            answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
            assert answer.status_code in (200, 503) and "status" in answer.json()
            # The oldest gave way to the newer ones; the rest, and the unfinished head, are closed once
            # --web.read-header-timeout has passed.
            assert all(closed_by_peer(sock) for sock in idle)
        assert proc.poll() is None
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code in (200, 503)


def test_the_systemd_unit_leaves_room_for_the_connections_and_the_agents() -> None:
    from pathlib import Path

    from gpufleet.server.settings import ServerSettings

    unit = (Path(__file__).parents[2] / "deploy" / "systemd" / "gpufleet-server.service").read_text()
    limits = [int(line.split("=", 1)[1]) for line in unit.splitlines() if line.startswith("LimitNOFILE=")]
    # Half the limit is the API's connection budget; the other half is for the agents pulled.
    assert limits and limits[0] // 2 >= ServerSettings().web_max_connections


def test_answers_under_docs_are_bounded_and_one_beyond_waits_then_is_told_to_retry() -> None:
    """Slow readers hold their answers' slots; the answer beyond the limit waits, then gets 503 Retry-After;
    other paths are not held up."""

    async def scenario() -> tuple[list, list, int]:
        release, both_in = asyncio.Event(), asyncio.Event()
        started: list[str] = []

        async def app(scope, receive, send):
            started.append(scope["path"])
            if len(started) == 2:
                both_in.set()
            if scope["path"].startswith("/docs"):
                await release.wait()  # a client that does not read: the answer is not done
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        limit = AnswerLimit(app, "/docs", 2, wait_seconds=0.05)

        async def call(path: str) -> list:
            sent: list = []

            async def send(message):
                sent.append(message)

            await limit({"type": "http", "path": path}, None, send)
            return sent

        slow = [asyncio.create_task(call("/docs/assets/swagger-ui-bundle.js")) for _ in range(2)]
        await asyncio.wait_for(both_in.wait(), 10)
        beyond = await call("/docs/assets/swagger-ui.css")
        other = await call("/alerts")
        release.set()
        await asyncio.gather(*slow)
        return beyond, other, limit.refused

    beyond, other, refused = asyncio.run(scenario())
    assert beyond[0]["status"] == 503 and (b"retry-after", b"1") in beyond[0]["headers"]
    assert b'"busy"' in beyond[1]["body"] and refused == 1
    assert other[0]["status"] == 200


def test_the_docs_are_served_through_the_limit(tmp_path) -> None:
    with server_process(tmp_path, "--targets", "127.0.0.1:1", "--web.max-large-answers", "1") as (_, port):
        page = httpx.get(f"http://127.0.0.1:{port}/docs", timeout=10)
        assert page.status_code == 200
        assets = re.findall(r'(/docs/assets/[^"]+)"', page.text)
        assert assets and all(httpx.get(f"http://127.0.0.1:{port}{a}", timeout=10).status_code == 200 for a in assets)


def test_max_requests_must_leave_room_above_the_connections() -> None:
    with pytest.raises(ConfigError, match=r"web.max-requests \(100\) must exceed web.max-connections \(1024\)"):
        load_settings(["--web.max-requests", "100"], env={})


def test_an_unfinished_head_over_max_header_bytes_is_400_and_the_next_client_is_served(tmp_path) -> None:
    with server_process(tmp_path, "--targets", "127.0.0.1:1", "--web.max-header-bytes", "4KiB") as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Padding: " + b"a" * 8192)  # and more to come
            assert sock.recv(100).startswith(b"HTTP/1.1 400 ")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code in (200, 503)
