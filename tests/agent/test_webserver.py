"""The HTTP endpoints on a real server bound to 127.0.0.1:0, fed from a store; time comes from a fake clock."""

from __future__ import annotations

import dataclasses
import errno
import gzip
import http.client
import logging
import socket
import struct
import threading

import orjson
import pytest

from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import SnapshotStore
from gpufleet.agent.connections import ConnectionLimits, _Waiting, request_end
from gpufleet.agent.webserver import AgentHttpServer, _RequestReader, _send_all
from tests.agent.fakes import FakeClock, StubReader


@pytest.fixture()
def agent():
    clock = FakeClock()
    store = SnapshotStore()
    reader = StubReader()
    sampler = Sampler(reader, store, node="dgx-017", clock=clock.time, monotonic=clock.monotonic, jitter=lambda: 0.5)
    server = AgentHttpServer(store, host="127.0.0.1", port=0, interval=1.0, clock=clock.time)
    server.start()
    yield server, sampler, clock, reader, store
    server.close()


def get(server, path, method="GET"):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type"), resp.read()
    finally:
        conn.close()


def test_binds_an_ephemeral_port(agent):
    server, *_ = agent
    assert server.port > 0 and server.host == "127.0.0.1"


def test_before_the_first_sample(agent):
    server, _, clock, *_ = agent
    assert get(server, "/healthz")[0] == 503
    assert orjson.loads(get(server, "/healthz")[2])["status"] == "starting"
    status, _, body = get(server, "/snapshot")
    assert status == 503 and orjson.loads(body)["error"] == "no_snapshot"
    assert orjson.loads(get(server, "/snapshots")[2]) == {"schema": 1, "node": "", "time": clock.now, "snapshots": []}


def test_metrics_carries_prerendered_body_and_age(agent):
    server, sampler, clock, *_ = agent
    sampler.run_once()
    clock.advance(2.5)
    status, ctype, body = get(server, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    assert b"gpufleet_gpu_utilization_ratio{" in body
    assert body.endswith(b'gpufleet_agent_sample_age_seconds{node="dgx-017"} 2.5\n')


def test_snapshot_is_the_latest(agent):
    server, sampler, clock, *_ = agent
    sampler.run_once()
    clock.advance(1)
    snap = sampler.run_once()
    status, ctype, body = get(server, "/snapshot")
    assert status == 200 and ctype == "application/json"
    assert orjson.loads(body) == orjson.loads(orjson.dumps(snap.to_dict()))


def test_snapshots_since(agent):
    server, sampler, clock, *_ = agent
    start = clock.now
    for _ in range(4):
        sampler.run_once()
        clock.advance(1)
    all_ = orjson.loads(get(server, "/snapshots")[2])
    assert all_["schema"] == 1 and all_["node"] == "dgx-017" and all_["time"] == start + 4  # the agent's clock now
    assert [s["time"] for s in all_["snapshots"]] == [start, start + 1, start + 2, start + 3]
    newer = orjson.loads(get(server, f"/snapshots?since={start + 1}")[2])
    assert [s["time"] for s in newer["snapshots"]] == [start + 2, start + 3]
    assert orjson.loads(get(server, f"/snapshots?since={start + 3}")[2])["snapshots"] == []


def test_snapshots_within_a_span_of_the_newest(agent):
    # A server pulling for the first time asks for a span, not the whole ring (whose size it cannot know).
    server, sampler, clock, *_ = agent
    start = clock.now
    for _ in range(4):
        sampler.run_once()
        clock.advance(1)
    spanned = orjson.loads(get(server, "/snapshots?span=1.5")[2])
    assert [s["time"] for s in spanned["snapshots"]] == [start + 2, start + 3]
    both = orjson.loads(get(server, f"/snapshots?since={start + 2}&span=2.5")[2])  # the later bound wins
    assert [s["time"] for s in both["snapshots"]] == [start + 3]
    for query in ("span=0", "span=-1", "span=abc", "span=inf"):
        status, _, body = get(server, f"/snapshots?{query}")
        assert status == 400 and orjson.loads(body)["error"] == "bad_span"


@pytest.mark.parametrize("query", ["since=", "since=abc", "since=nan", "since=inf", "since=1e999"])
def test_bad_since_is_400(agent, query):
    server, *_ = agent
    status, ctype, body = get(server, f"/snapshots?{query}")
    assert status == 400 and ctype == "application/json" and orjson.loads(body)["error"] == "bad_since"


def test_healthz_goes_stale_when_sampling_stalls(agent):
    server, sampler, clock, *_ = agent
    sampler.run_once()
    status, _, body = get(server, "/healthz")
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    clock.advance(9.9)  # max(3 x 1 s, 10 s)
    assert get(server, "/healthz")[0] == 200
    clock.advance(0.2)
    status, _, body = get(server, "/healthz")
    doc = orjson.loads(body)
    assert status == 503 and doc["status"] == "stale" and doc["age_seconds"] == pytest.approx(10.1)
    sampler.run_once()  # sampling resumes
    assert get(server, "/healthz")[0] == 200


def test_nvml_call_hung_in_the_sampler_thread_shows_as_age_not_a_hung_endpoint(agent):
    server, sampler, clock, reader, store = agent
    first = sampler.run_once()
    entered, release = threading.Event(), threading.Event()

    def hang() -> None:  # a driver call that does not return until released
        entered.set()
        release.wait(30)

    reader.read_effects = [hang]
    sampler.start()
    try:
        assert entered.wait(10)
        clock.advance(30.0)
        status, _, body = get(server, "/metrics")
        assert status == 200 and body.endswith(b'gpufleet_agent_sample_age_seconds{node="dgx-017"} 30.0\n')
        status, _, body = get(server, "/healthz")
        assert status == 503 and orjson.loads(body)["status"] == "stale"
        assert orjson.loads(get(server, "/snapshot")[2])["time"] == first.time
        sampler.stop(timeout=0)  # gives up on the hung cycle at once...
        assert reader.closed == 0  # ...without shutting NVML down under the call still inside it
    finally:
        release.set()
        sampler._thread.join(10)
    assert not sampler._thread.is_alive()


def test_first_nvml_init_hung_still_answers_with_health(agent):
    server, sampler, clock, reader, store = agent
    entered, release = threading.Event(), threading.Event()

    def hung_open() -> None:  # nvmlInit stuck in a wedged driver
        entered.set()
        release.wait(30)

    reader.open = hung_open
    sampler.start()
    try:
        assert entered.wait(10)
        status, _, body = get(server, "/metrics")
        assert status == 200 and b'gpufleet_agent_nvml_up{node="dgx-017"} 0.0' in body
        assert b"gpufleet_gpu_" not in body
        status, _, body = get(server, "/healthz")
        assert status == 503 and orjson.loads(body)["status"] == "starting"
        sampler.stop(timeout=0)
    finally:
        release.set()
        sampler._thread.join(10)
    assert not sampler._thread.is_alive()


def test_healthz_and_metrics_while_nvml_is_down(agent):
    server, sampler, clock, reader, store = agent
    reader.open_failures = 5
    sampler.run_once()
    status, _, body = get(server, "/healthz")
    assert status == 503 and orjson.loads(body)["status"] == "nvml_down"
    status, _, metrics = get(server, "/metrics")
    assert status == 200 and b'gpufleet_agent_nvml_up{node="dgx-017"} 0.0' in metrics
    assert b"gpufleet_gpu_" not in metrics and b"sample_age" not in metrics


def test_stale_interval_scales_with_long_intervals():
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, interval=30.0)
    try:
        assert server.stale_after == 90.0
    finally:
        server.close()


@pytest.mark.parametrize("path", ["/", "/metrics/", "/snapshot/x", "/nope"])
def test_unknown_path_is_404_json(agent, path):
    server, *_ = agent
    status, ctype, body = get(server, path)
    assert status == 404 and ctype == "application/json" and orjson.loads(body)["error"] == "not_found"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_other_methods_are_405(agent, method):
    server, *_ = agent
    status, ctype, body = get(server, "/metrics", method=method)
    assert status == 405 and orjson.loads(body)["error"] == "method_not_allowed"


def test_head_has_no_body(agent):
    server, sampler, *_ = agent
    sampler.run_once()
    status, _, body = get(server, "/metrics", method="HEAD")
    assert status == 200 and body == b""


def test_keep_alive_serves_several_requests_on_one_connection(agent):
    server, sampler, *_ = agent
    sampler.run_once()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for path in ("/metrics", "/snapshot", "/healthz"):
            conn.request("GET", path)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
    finally:
        conn.close()


def test_a_failing_handler_costs_one_request_not_the_server(agent):
    server, sampler, clock, reader, store = agent
    sampler.run_once()
    good = store.latest()
    store.publish(dataclasses.replace(good, health=None))  # a corrupt publication: handlers raise
    assert get(server, "/healthz")[0] == 500
    store.publish(good)
    assert get(server, "/healthz")[0] == 200


def test_snapshot_endpoint_never_touches_the_reader(agent):
    server, sampler, clock, reader, store = agent
    sampler.run_once()
    reads = reader.reads
    for path in ("/metrics", "/snapshot", "/snapshots", "/healthz"):
        assert get(server, path)[0] == 200
    assert reader.reads == reads


def test_the_pre_outage_ring_is_not_served_after_nvml_comes_back(agent):
    server, sampler, clock, reader, store = agent
    before = clock.now
    for _ in range(3):
        sampler.run_once()
        clock.advance(1)

    def gone() -> None:
        from gpufleet.agent.nvml_reader import NvmlUnavailable

        raise NvmlUnavailable("GPU is lost")

    reader.read_effects = [gone]
    sampler.run_once()  # NVML goes away; the last snapshot stays published
    reader.open_failures = 10**6
    for _ in range(40):  # an outage well past the 300 s retention
        clock.advance(10)
        sampler.run_once()
    doc = orjson.loads(get(server, "/snapshots")[2])
    assert doc["snapshots"] == [] and len(store) == 0
    reader.open_failures = 0  # NVML is back
    clock.advance(60)  # past the open backoff
    snap = sampler.run_once()
    assert snap is not None
    doc = orjson.loads(get(server, "/snapshots")[2])
    assert [s["time"] for s in doc["snapshots"]] == [snap.time] and snap.time > before + 400


# --- methods, bodies and framing ------------------------------------------------------------------------


def raw_exchange(server, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("method", ["TRACE", "CONNECT", "OPTIONS", "PROPFIND", "POST"])
def test_every_method_but_get_and_head_is_405_json_with_allow(agent, method):
    server, *_ = agent
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 405 and resp.getheader("Content-Type") == "application/json"
        assert resp.getheader("Allow") == "GET, HEAD" and orjson.loads(body)["error"] == "method_not_allowed"
    finally:
        conn.close()


def test_a_request_after_a_body_on_one_connection_is_read_as_its_own(agent):
    server, sampler, *_ = agent
    sampler.run_once()
    answer = raw_exchange(
        server,
        b"POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
        b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    first, second = answer.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"405 ") and second.startswith(b"200 ")
    assert b'"status":"ok"' in second and b"400" not in answer


def test_a_body_over_the_limit_is_answered_and_the_connection_closed(agent):
    server, *_ = agent
    # The body is never sent: the answer must not wait for it, and the connection must not be reused.
    answer = raw_exchange(server, b"POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 10000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 405 ") and b"\r\nConnection: close\r\n" in answer
    answer = raw_exchange(server, b"GET /healthz HTTP/1.1\r\nHost: a\r\nContent-Length: 10000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"error":"body_too_large"' in answer


def test_a_chunked_request_is_answered_then_closed(agent):
    server, *_ = agent
    answer = raw_exchange(
        server,
        b"GET /healthz HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    assert answer.count(b"HTTP/1.1 ") == 1 and b"\r\nConnection: close\r\n" in answer


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        b"Content-Length: -1\r\n",
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    ],
)
def test_ambiguous_body_framing_is_400_json(agent, headers):
    server, *_ = agent
    answer = raw_exchange(server, b"POST /metrics HTTP/1.1\r\nHost: a\r\n" + headers + b"\r\nhello")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"Content-Type: application/json" in head
    assert orjson.loads(body)["error"] == "bad_request"


def test_http_server_errors_are_json(agent):
    server, *_ = agent
    answer = raw_exchange(server, b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 414 ") and orjson.loads(body)["error"] == "request_uri_too_long"
    answer = raw_exchange(server, b"GET /metrics HTTP/2.0\r\n\r\n")
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"] == "http_version_not_supported"


# --- gzip -----------------------------------------------------------------------------------------------


def get_metrics(server, accept_encoding: str | None, method: str = "GET"):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, "/metrics", headers={"Accept-Encoding": accept_encoding} if accept_encoding else {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_metrics_are_gzipped_when_the_client_accepts_gzip(agent):
    server, sampler, clock, *_ = agent
    sampler.run_once()
    clock.advance(1.5)
    _, plain_headers, plain = get_metrics(server, None)
    # What Prometheus sends.
    status, headers, body = get_metrics(server, "gzip")
    assert status == 200 and headers["Content-Encoding"] == "gzip" and headers["Vary"] == "Accept-Encoding"
    assert "Content-Encoding" not in plain_headers and plain_headers["Vary"] == "Accept-Encoding"
    assert gzip.decompress(body) == plain and int(headers["Content-Length"]) == len(body) < len(plain) / 4
    assert body[:2] == b"\x1f\x8b"


@pytest.mark.parametrize("value", ["identity", "gzip;q=0", "deflate, br", "x-gzip;q=bad"])
def test_metrics_are_plain_unless_gzip_is_accepted(agent, value):
    server, sampler, *_ = agent
    sampler.run_once()
    status, headers, body = get_metrics(server, value)
    assert status == 200 and "Content-Encoding" not in headers and body.startswith(b"# HELP")


def test_a_body_is_compressed_once_however_often_it_is_scraped(agent):
    server, sampler, clock, *_ = agent
    sampler.run_once()
    bodies = []
    for _ in range(3):
        clock.advance(0.5)  # each scrape carries its own sample age
        bodies.append(gzip.decompress(get_metrics(server, "deflate, gzip;q=0.5")[2]))
    assert server.gzip.compressions == 1
    assert [b.rsplit(b" ", 1)[1] for b in bodies] == [b"0.5\n", b"1.0\n", b"1.5\n"]
    status, headers, body = get_metrics(server, "gzip", method="HEAD")
    assert status == 200 and body == b"" and headers["Content-Encoding"] == "gzip"
    sampler.run_once()
    assert gzip.decompress(get_metrics(server, "gzip")[2]) == get_metrics(server, None)[2]
    assert server.gzip.compressions == 2


# --- connections ----------------------------------------------------------------------------------------


def test_the_listen_backlog_suits_a_scrape_fleet(agent):
    server, *_ = agent
    assert server._listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    assert server.limits.max_connections >= 128


def test_connections_that_send_nothing_cost_no_worker_and_give_way_to_new_ones():
    limits = ConnectionLimits(max_connections=4, max_requests=1)
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, limits=limits)
    server.start()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
    try:
        # The one worker is free for a fifth client: it takes the place of the oldest silent connection.
        assert get(server, "/healthz")[0] == 503  # no sample yet: starting
        assert held[0].recv(100) == b""
        assert server.gate.evicted >= 1
        for sock in held[1:]:  # the others are still served
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in held:
            sock.close()
        server.close()


def test_one_address_gives_way_to_itself_not_to_others():
    limits = ConnectionLimits(max_connections_per_address=2)
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, limits=limits)
    server.start()
    other = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0))
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(2)]
    try:
        assert server.gate.wait_for_held(3, timeout=10)
        newest = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        with newest:
            assert held[0].recv(100) == b""  # 127.0.0.1's oldest made room
            newest.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            assert newest.recv(100).startswith(b"HTTP/1.1 503 ")
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")  # another address is untouched
        assert other.recv(100).startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in (*held, other):
            sock.close()
        server.close()


def test_large_answers_beyond_the_cap_are_503_busy_with_retry_after(agent):
    server, sampler, *_ = agent
    sampler.run_once()
    for _ in range(server.limits.max_large_answers):  # answers in flight to clients that read slowly
        server.large_answers.acquire()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/snapshots")
        resp = conn.getresponse()
        assert resp.status == 503 and resp.getheader("Retry-After") == "1"
        assert orjson.loads(resp.read())["error"] == "busy"
        conn.close()
        assert get(server, "/metrics")[0] == 503
        assert get(server, "/healthz")[0] == 200  # small answers are not held up
    finally:
        for _ in range(server.limits.max_large_answers):
            server.large_answers.release()
    assert get(server, "/snapshots")[0] == 200 and server.busy_answers == 2


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline():
    server = AgentHttpServer(
        SnapshotStore(), host="127.0.0.1", port=0, limits=ConnectionLimits(read_header_timeout_seconds=0.2)
    )
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            assert sock.recv(100) == b""
        assert server.gate.wait_for(0, timeout=10)
        assert server.gate.expired == 1
    finally:
        server.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout():
    limits = ConnectionLimits(keep_alive_timeout_seconds=0.2)
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, limits=limits)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            answer = b""
            while not answer.endswith(b"}"):
                answer += sock.recv(1000)
            assert sock.recv(100) == b""
        assert server.gate.expired == 1
    finally:
        server.close()


def test_a_request_must_arrive_whole_before_its_deadline_however_it_trickles():
    a, b = socket.socketpair()
    now = [0.0]
    with a, b:
        reader = _RequestReader(a, b"GET", 30.0, lambda: now[0])
        assert reader.read(3) == b"GET"
        now[0] = 29.0
        b.sendall(b" /")  # each byte in time for a per-read timeout...
        assert reader.read(2) == b" /"
        now[0] = 30.5
        b.sendall(b"metrics")
        with pytest.raises(TimeoutError):  # ...but not for the request's deadline
            reader.read(7)


@pytest.mark.parametrize(
    ("data", "end"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\n", None),
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET", 27),
        (b"GET / HTTP/1.1\nHost: a\n\n", 24),
        (b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nab", None),
        (b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcdGET", 42),
        (b"POST / HTTP/1.1\r\nContent-Length: 999999\r\n\r\nab", 43),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4", 47),
        (b"X" * 70000, 70000),
    ],
)
def test_a_request_is_handed_to_a_worker_once_its_head_and_small_body_are_in(data, end):
    assert request_end(data) == end


def test_repeated_accept_errors_are_logged_once_per_interval_with_a_count(caplog):
    mono, pauses = [100.0], []
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, monotonic=lambda: mono[0], pause=pauses.append)
    real = server.gate.listener

    class OutOfDescriptors:
        def accept(self):
            raise OSError(errno.EMFILE, "Too many open files")

    server.gate.listener = OutOfDescriptors()
    try:
        with caplog.at_level(logging.WARNING, logger="gpufleet.agent.connections"):
            for _ in range(1000):
                server.gate.accept()
            mono[0] += 60.0
            server.gate.accept()
    finally:
        server.gate.listener = real
        server.close()
    lines = [r for r in caplog.records if r.getMessage() == "cannot accept connections"]
    assert [(r.kind, r.count) for r in lines] == [("accept:EMFILE", 1), ("accept:EMFILE", 1000)]
    assert pauses == [0.1] * 1001  # the accept loop backs off instead of spinning


def test_a_client_reset_is_one_structured_debug_line_not_a_traceback(agent, caplog, capfd):
    server, sampler, *_ = agent
    sampler.run_once()
    with caplog.at_level(logging.DEBUG, logger="gpufleet.agent"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: a\r\n")  # headers not finished
        assert server.gate.wait_for_held(1, timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
        assert server.gate.wait_for(0, timeout=10)
    lost = [r for r in caplog.records if r.getMessage() == "http client connection lost"]
    assert lost and all(r.levelno == logging.DEBUG and r.exc_info is None for r in lost)
    assert lost[-1].error == "ConnectionResetError" and lost[-1].client == "127.0.0.1"
    assert "Traceback" not in capfd.readouterr().err
    assert get(server, "/healthz")[0] == 200


def test_a_client_gone_before_accept_is_not_an_accept_failure(caplog):
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, pause=lambda s: pytest.fail("paused"))
    real = server.gate.listener

    class Aborted:
        def accept(self):
            raise ConnectionAbortedError(errno.ECONNABORTED, "Software caused connection abort")

    server.gate.listener = Aborted()
    try:
        with caplog.at_level(logging.WARNING, logger="gpufleet.agent.connections"):
            server.gate.accept()
    finally:
        server.gate.listener = real
        server.close()
    assert not caplog.records and not server.gate.warn.totals


def test_the_gate_thread_sleeps_until_a_deadline_and_for_ever_with_none():
    now = [100.0]
    server = AgentHttpServer(SnapshotStore(), host="127.0.0.1", port=0, monotonic=lambda: now[0])
    gate = server.gate
    a, b = socket.socketpair()
    with a, b:
        assert gate._select_timeout(next_tick=now[0]) is None  # nothing waits: no wakeups at all
        gate._wait(_Waiting(a, ("127.0.0.1", 1), b"", deadline=105.0, handshaking=False))
        gate._wait(_Waiting(b, ("127.0.0.1", 2), b"", deadline=103.0, handshaking=False))
        assert gate._select_timeout(next_tick=now[0]) == 3.0  # the earliest deadline
        assert gate._select_timeout(next_tick=104.0) == 4.0  # but never before the next tick
        now[0] = 110.0
        assert gate._select_timeout(next_tick=now[0]) == 0.0  # overdue: expire at once
    server.close()


class _ShortSocket:
    """A socket whose send buffer takes only `room` bytes of the first write, as a full one does."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.out = bytearray()

    def sendmsg(self, buffers):
        data = b"".join(buffers)
        taken = min(self.room, len(data))
        self.out += data[:taken]
        return taken

    def sendall(self, data):
        self.out += bytes(data)


@pytest.mark.parametrize("room", [0, 3, 6, 10, 100_000])
def test_an_answer_written_in_one_call_is_finished_whatever_the_socket_took(room):
    sock = _ShortSocket(room)
    _send_all(sock, b"HEAD\r\n", b"body bytes")
    assert bytes(sock.out) == b"HEAD\r\nbody bytes"
