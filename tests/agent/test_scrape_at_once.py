"""A scrape whose answer is ready is sent by the thread that reads request heads, no worker woken; anything
else, or anything it cannot send at once, goes to a worker as before. Real server on 127.0.0.1:0."""

from __future__ import annotations

import gzip
import socket
import zlib

import orjson
import pytest

from gpufleet.agent.health import AgentHealth
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import Publication, SnapshotStore
from gpufleet.agent.webserver import AgentHttpServer, GzipCache, plain_get
from tests.agent.fakes import FakeClock, StubReader, snapshot

SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: gzip\r\nUser-Agent: Prometheus/3.5.0\r\n\r\n"
PLAIN = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture()
def agent():
    clock = FakeClock()
    store = SnapshotStore()
    server = AgentHttpServer(store, host="127.0.0.1", port=0, interval=1.0, clock=clock.time)
    sampler = Sampler(
        StubReader(),
        store,
        node="dgx-017",
        clock=clock.time,
        monotonic=clock.monotonic,
        jitter=lambda: 0.5,
        rendered_ahead=server.prepare,
    )
    server.start()
    yield server, sampler, clock, store
    server.close()


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP answer framed by its Content-Length: (head, body). Read unbuffered, a byte at a time up to
    the body, so that nothing of a pipelined answer after it is taken from the socket."""
    raw = sock.makefile("rb", buffering=0)
    lines = []
    while (line := raw.readline()) not in (b"\r\n", b""):
        lines.append(line.rstrip(b"\r\n"))
    assert line, "connection closed before the end of the head"
    head = b"\r\n".join(lines)
    length = int(next(x for x in lines if x.lower().startswith(b"content-length:")).split(b":")[1])
    body = b""
    while len(body) < length:
        chunk = raw.read(length - len(body))
        assert chunk, "connection closed inside the body"
        body += chunk
    return head, body


def exchange(sock: socket.socket, request: bytes) -> tuple[bytes, bytes]:
    sock.sendall(request)
    return read_answer(sock)


def without_date(head: bytes) -> bytes:
    return b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"Date:"))


@pytest.mark.parametrize("request_bytes", [SCRAPE, PLAIN])
def test_a_ready_scrape_is_answered_at_once_with_the_bytes_a_worker_sends(agent, request_bytes):
    server, sampler, clock, _ = agent
    sampler.run_once()
    # A Content-Length makes the same request one for a worker (the gate answers only plain GETs).
    by_worker = request_bytes[:-2] + b"Content-Length: 0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        worker_head, worker_body = exchange(sock, by_worker)  # renders, compresses: a worker's job
        assert server.gate.answered_here == 0
        head, body = exchange(sock, request_bytes)  # on the same kept connection
        assert server.gate.answered_here == 1
        assert without_date(head) == without_date(worker_head) and body == worker_body
        clock.advance(1.5)  # each scrape carries its own sample age
        _, later = exchange(sock, request_bytes)
        assert server.gate.answered_here == 2
    text = gzip.decompress(later) if b"gzip" in request_bytes else later
    assert text.endswith(b'gpufleet_agent_sample_age_seconds{node="dgx-017"} 1.5\n')
    assert b"gpufleet_gpu_utilization_ratio{" in text


def test_a_text_rendered_ahead_is_compressed_ahead_and_its_first_scrape_answered_at_once(agent):
    server, sampler, clock, _ = agent
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        answered = []
        for _ in range(5):  # a scraper every second: from the third the sampler renders ahead of it
            sampler.run_once()
            before = server.gate.answered_here
            _, body = exchange(sock, SCRAPE)
            answered.append(server.gate.answered_here - before)
            assert gzip.decompress(body).startswith(b"# HELP")
            clock.advance(1.0)
        assert answered[:2] == [0, 0] and answered[-2:] == [1, 1]
        # One compression per text, whoever did it.
        assert server.gzip.compressions == 5


def test_pipelined_scrapes_are_answered_in_order(agent):
    server, sampler, *_ = agent
    sampler.run_once()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        exchange(sock, PLAIN)  # renders
        sock.sendall(PLAIN + SCRAPE + b"GET /nothing HTTP/1.1\r\n\r\n")
        first, second, third = read_answer(sock), read_answer(sock), read_answer(sock)
    assert first[1].startswith(b"# HELP") and gzip.decompress(second[1]) == first[1]
    assert third[0].startswith(b"HTTP/1.1 404") and orjson.loads(third[1])["error"] == "not_found"


def test_an_answer_the_socket_does_not_take_at_once_is_finished_by_a_worker():
    store = SnapshotStore()
    # Far more than loopback's socket buffers take in one send.
    text = b"# HELP big A body larger than a socket buffer.\n" + b"x" * (16 << 20) + b"\n"
    health = AgentHealth(node="dgx-017", version="0.1.0", nvml_up=True)
    snap = snapshot(n=1, time=1763800000.0)
    store.publish(Publication(snap, health, text, orjson.dumps(snap.to_dict())))
    server = AgentHttpServer(store, host="127.0.0.1", port=0, clock=lambda: 1763800001.0)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            _, body = exchange(sock, PLAIN)
            assert server.gate.answered_here == 1
            assert body.startswith(text) and len(body) > len(text)
            _, again = exchange(sock, PLAIN)  # the connection is kept, and its answer slot was given back
            assert again == body and server.gate.answered_here == 2
    finally:
        server.close()
    assert all(server.large_answers.acquire(blocking=False) for _ in range(server.limits.max_large_answers))


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /metrics HTTP/1.0\r\n\r\n",
        b"HEAD /metrics HTTP/1.1\r\n\r\n",
        b"get /metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics?x=1 HTTP/1.1\r\n\r\n",
        b"GET /metrics/ HTTP/1.1\r\n\r\n",
        b"GET /snapshot HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\n\n",
        b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nX: a\nY: b\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n",
    ],
)
def test_anything_but_a_plain_keep_alive_get_goes_to_a_worker(request_bytes):
    assert plain_get(request_bytes, b"/metrics") is None


def test_a_plain_get_gives_its_headers():
    request = b"GET /metrics HTTP/1.1\r\nHost: a\r\nAccept-Encoding: gzip\r\naccept-encoding:  br \r\nConnection: Keep-Alive\r\n\r\n"
    headers = plain_get(request, b"/metrics")
    assert headers == {b"host": [b"a"], b"accept-encoding": [b"gzip", b"br"], b"connection": [b"Keep-Alive"]}


def test_the_gzip_cache_compresses_ahead_only_for_gzip_scrapers_and_never_waits():
    cache = GzipCache()
    text = b"# HELP a A.\n" * 100
    cache.prepare(text)
    assert cache.compressions == 0 and cache.ready(text) is None  # no scrape asked for gzip yet
    first = cache.compress(text, b"tail\n")
    cache.prepare(text + b"more\n")
    assert cache.compressions == 2
    parts = cache.ready(text + b"more\n", b"tail\n")
    assert parts is not None and gzip.decompress(b"".join(parts)) == text + b"more\ntail\n"
    assert gzip.decompress(first) == text + b"tail\n"
    with cache._lock:  # a compression of the next text under way: the texts kept are still answered at once
        older = cache.ready(text, b"tail\n")
        assert older is not None and gzip.decompress(b"".join(older)) == text + b"tail\n"
    cache.prepare(text + b"third\n")
    assert cache.ready(text) is None and cache.ready(text + b"more\n") is not None  # the newest two are kept


@pytest.mark.parametrize("tail", [b"", b"gpufleet_agent_sample_age_seconds 0.5\n", b"z" * 65535, b"q" * 70000])
def test_each_scrapes_own_lines_close_the_kept_stream_as_one_valid_gzip_member(tail):
    cache = GzipCache()
    text = b"# HELP a A.\n" * 10000
    answer = cache.compress(text, tail)
    inflater = zlib.decompressobj(31)  # one member, checked to its trailer (CRC-32 and length)
    assert inflater.decompress(answer) == text + tail and inflater.eof and not inflater.unused_data
    assert len(answer) < len(text) // 10 + len(tail) + 100  # the text compressed once, the tail stored
