"""The HTTP endpoints on a real server bound to 127.0.0.1:0, fed from a store; time comes from a fake clock."""

from __future__ import annotations

import dataclasses
import http.client
import threading

import orjson
import pytest

from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import SnapshotStore
from gpufleet.agent.webserver import AgentHttpServer
from tests.agent.fakes import FakeClock, StubReader


@pytest.fixture()
def agent():
    clock = FakeClock()
    store = SnapshotStore()
    reader = StubReader()
    sampler = Sampler(reader, store, node="dgx-017", clock=clock.time, monotonic=clock.monotonic,
                      jitter=lambda: 0.5)
    server = AgentHttpServer(store, host="127.0.0.1", port=0, interval=1.0, clock=clock.time, poll_interval=0.01)
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
    assert orjson.loads(get(server, "/snapshots")[2]) == {"schema": 1, "node": "", "time": clock.now,
                                                         "snapshots": []}


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
    assert all_["schema"] == 1 and all_["node"] == "dgx-017" and all_["time"] == start + 4   # the agent's clock now
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
    both = orjson.loads(get(server, f"/snapshots?since={start + 2}&span=2.5")[2])      # the later bound wins
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
