"""Reading the agents through Prometheus: scrapes rebuilt into snapshots, nothing repeated or lost between
cycles, unsupported readings absent, and every failure of Prometheus or of its answer counted, never raised."""

from __future__ import annotations

import asyncio
import re

import httpx
import orjson
import pytest

from gpufleet.server.contract import parse_snapshot
from gpufleet.server.ingest.prometheus import PrometheusSource
from gpufleet.server.serve import build_source
from gpufleet.server.settings import ConfigError, load_settings

MODEL = "NVIDIA H100 80GB HBM3"


def series(
    name: str, node: str, gpu: int, points: list[tuple[float, float]], instance: str = "10.0.0.1:9471", **extra: str
) -> dict:
    labels = {
        "__name__": name,
        "node": node,
        "gpu": str(gpu),
        "uuid": f"GPU-{node}-{gpu}",
        "model": MODEL,
        "instance": instance,
        "job": "gpufleet-agent",
        **extra,
    }
    return {"metric": labels, "values": [[t, repr(v)] for t, v in points]}


def gpu_series(
    node: str,
    gpu: int,
    times: list[float],
    *,
    util: float = 0.9,
    with_sm: bool = True,
    job: str | None = "71001",
    instance: str = "10.0.0.1:9471",
) -> list[dict]:
    """The series one agent exports for one GPU, sampled at each scrape time."""

    def s(name, value, **extra):
        return series(name, node, gpu, [(t, value) for t in times], instance, **extra)

    out = [
        s("gpufleet_gpu_up", 1.0),
        s("gpufleet_gpu_utilization_ratio", util),
        s("gpufleet_gpu_temperature_celsius", 70.0 + gpu),
        s("gpufleet_gpu_temperature_limit_celsius", 89.0, limit="slowdown"),
        s("gpufleet_gpu_temperature_limit_celsius", 92.0, limit="shutdown"),
        s("gpufleet_gpu_temperature_limit_celsius", 95.0, limit="memory_max_operating"),
        s("gpufleet_gpu_memory_temperature_celsius", 60.0 + gpu),
        s("gpufleet_gpu_power_watts", 650.0),
        s("gpufleet_gpu_power_limit_watts", 700.0),
        series("gpufleet_gpu_energy_joules_total", node, gpu, [(t, 1000.0 + 650.0 * t) for t in times], instance),
        s("gpufleet_gpu_clock_hertz", 1.98e9, clock="sm"),
        s("gpufleet_gpu_clock_hertz", 2.6e9, clock="memory"),
        s("gpufleet_gpu_clock_max_hertz", 1.98e9, clock="sm"),
        s("gpufleet_gpu_clock_max_hertz", 2.6e9, clock="memory"),
        s("gpufleet_gpu_throttle_reasons", 0.0),
        s("gpufleet_gpu_ecc_errors_total", 5.0, type="corrected"),
        s("gpufleet_gpu_ecc_errors_total", 0.0, type="uncorrected"),
        s("gpufleet_gpu_remapped_rows_pending", 0.0),
        s("gpufleet_gpu_remapped_rows_failure", 0.0),
    ]
    if with_sm:
        out.append(s("gpufleet_gpu_sm_active_ratio", 0.8))
    if job is not None:
        job_info = series("gpufleet_gpu_job_info", node, gpu, [(t, 1.0) for t in times], instance, hpc_job=job)
        del job_info["metric"]["model"]  # the agent's job series carries no model label
        out.append(job_info)
    return out


class FakePrometheus:
    """A MockTransport handler answering /api/v1/query like Prometheus: range selectors with the stored
    points inside (time - range, time], `up` as an instant vector."""

    def __init__(self) -> None:
        self.stored: list[dict] = []
        self.up: dict[str, str] = {}
        self.queries: list[tuple[str, float]] = []
        self.override: httpx.Response | Exception | None = None

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query"
        query, at = request.url.params["query"], float(request.url.params["time"])
        self.queries.append((query, at))
        if isinstance(self.override, Exception):
            raise self.override
        if self.override is not None:
            return self.override
        if query.startswith("up{"):
            result = [
                {"metric": {"__name__": "up", "instance": i, "job": "gpufleet-agent"}, "value": [at, v]}
                for i, v in sorted(self.up.items())
            ]
            return httpx.Response(
                200, content=orjson.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
            )
        seconds = float(re.search(r"\[(\d+)s\]$", query).group(1))
        result = []
        for s in self.stored:
            if not isinstance(s, dict) or not all(isinstance(p[0], float) for p in s["values"] if p):
                result.append(s)  # garbage, as a broken proxy in front of Prometheus might pass on
                continue
            values = [p for p in s["values"] if at - seconds < p[0] <= at]
            if values:
                result.append({"metric": s["metric"], "values": values})
        return httpx.Response(
            200, content=orjson.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}})
        )


def make_source(prom: FakePrometheus, **kwargs) -> tuple[PrometheusSource, list[float]]:
    now = [1000.0]
    src = PrometheusSource(
        "http://prometheus:9090",
        transport=httpx.MockTransport(prom.handler),
        clock=lambda: now[0],
        parse=parse_snapshot,
        **kwargs,
    )
    return src, now


def run(coro):
    return asyncio.run(coro)


def test_each_scrape_of_a_node_becomes_one_snapshot_with_the_contract_readings() -> None:
    prom = FakePrometheus()
    prom.stored = (
        gpu_series("dgx-01", 0, [990.0, 995.0])
        + gpu_series("dgx-01", 1, [990.0, 995.0], with_sm=False)
        + gpu_series("dgx-02", 0, [991.0], job=None, instance="10.0.0.2:9471")
    )
    prom.stored.append(series("gpufleet_gpu_xid_errors_total", "dgx-01", 1, [(995.0, 2.0)], xid="79"))
    prom.stored.append(series("gpufleet_gpu_xid_errors_total", "dgx-01", 1, [(995.0, 1.0)], xid="48"))
    src, _ = make_source(prom)

    result = run(src.pull_once())

    assert [(s.node, s.time) for s in result.samples] == [("dgx-01", 990.0), ("dgx-02", 991.0), ("dgx-01", 995.0)]
    first, unattributed, last = result.samples
    assert first.indices == (0, 1) and first.uuids == ("GPU-dgx-01-0", "GPU-dgx-01-1")
    assert first.models == (MODEL, MODEL) and first.jobs == ("71001", "71001")
    assert unattributed.jobs == (None,)
    assert first.value(0, "utilization_ratio") == pytest.approx(0.9)
    assert first.value(0, "sm_clock_hertz") == 1.98e9  # the sm clock, not the memory clock
    assert first.value(0, "slowdown_temperature_celsius") == 89.0  # slowdown, not shutdown
    assert first.value(1, "memory_temperature_celsius") == 61.0  # HBM, beside the die's 71
    assert first.value(0, "memory_max_operating_temperature_celsius") == 95.0
    assert first.value(0, "ecc_uncorrected_errors_total") == 0.0  # uncorrected only
    assert first.value(0, "energy_joules_total") == pytest.approx(1000.0 + 650.0 * 990.0)
    assert first.value(0, "up") == 1.0
    # A reading the GPU has no series for is unsupported (absent), never 0.
    assert first.value(0, "sm_active_ratio") == pytest.approx(0.8)
    assert first.value(1, "sm_active_ratio") is None
    # XID counts by code, and a total that starts from 0 so the first XID counts.
    assert first.value(0, "xid_errors_total") == 0.0
    assert last.value(1, "xid_errors_total") == 3.0
    assert last.xid_by_code[1] == {79: 2, 48: 1}
    assert result.failed_targets == 0 and result.rejected_snapshots == 0 and not src.errors


def test_cycles_deliver_each_scrape_once_and_ask_for_just_enough_history() -> None:
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [996.0, 998.0])
    src, now = make_source(prom, interval_seconds=5.0, max_lookback_seconds=300.0)

    first = run(src.pull_once())
    prom.stored = gpu_series("dgx-01", 0, [996.0, 998.0, 1000.0, 1003.0])  # two new scrapes, old ones still there
    now[0] = 1005.0
    second = run(src.pull_once())
    now[0] = 1010.0
    third = run(src.pull_once())
    now[0] = 2000.0  # a long outage of the server itself
    run(src.pull_once())

    assert [s.time for s in first.samples] == [996.0, 998.0]
    assert [s.time for s in second.samples] == [1000.0, 1003.0]
    assert third.samples == []
    ranges = [int(re.search(r"\[(\d+)s\]$", q).group(1)) for q, _ in prom.queries if not q.startswith("up")]
    # First cycle: the cap (warms the windows); then the time since the last query plus two intervals.
    assert ranges == [300, 15, 15, 300]
    assert [t for q, t in prom.queries if not q.startswith("up")] == [1000.0, 1005.0, 1010.0, 2000.0]


def test_a_range_prometheus_cannot_answer_in_time_is_halved_until_it_can_then_grows_back() -> None:
    # A big fleet's five minutes of history (the first cycle, or the backlog after an outage) can take
    # Prometheus longer than the timeout; asked for again each cycle it would fail forever.
    prom = FakePrometheus()
    slow = [True]

    def slow_on_long_ranges(request: httpx.Request) -> httpx.Response:
        query = request.url.params["query"]
        if slow[0] and not query.startswith("up") and int(re.search(r"\[(\d+)s\]$", query).group(1)) > 60:
            prom.queries.append((query, float(request.url.params["time"])))
            raise httpx.ReadTimeout("too much to answer in time")
        return prom.handler(request)

    now = [1000.0]
    src = PrometheusSource(
        "http://prometheus:9090",
        transport=httpx.MockTransport(slow_on_long_ranges),
        clock=lambda: now[0],
        parse=parse_snapshot,
        interval_seconds=5.0,
        max_lookback_seconds=300.0,
    )
    delivered = []
    for t in (1000.0, 1005.0, 1010.0, 1015.0, 1020.0, 1025.0):
        now[0] = t
        prom.stored = gpu_series("dgx-01", 0, [float(x) for x in range(705, int(t) + 1, 5)])
        delivered += [s.time for s in run(src.pull_once()).samples]
    slow[0] = False
    now[0] = 2000.0  # a long outage of the server itself
    run(src.pull_once())

    ranges = [int(re.search(r"\[(\d+)s\]$", q).group(1)) for q, _ in prom.queries if not q.startswith("up")]
    # 300, 150 and 75 time out; 37.5 is answered, and from then on each cycle asks for what it missed. Each
    # good answer doubles the cap back: after three, a long gap asks for the whole 300 s again.
    assert ranges == [300, 150, 75, 38, 15, 15, 300]
    assert src.errors[("http://prometheus:9090", "timeout")] == 3
    # What the shortened range left out is a gap; nothing after it is lost or repeated.
    assert delivered == [float(x) for x in range(980, 1026, 5)]


def age_series(node: str, points: list[tuple[float, float]], instance: str = "10.0.0.1:9471") -> dict:
    """The agent's gpufleet_agent_sample_age_seconds: per node, set at each scrape."""
    return {
        "metric": {
            "__name__": "gpufleet_agent_sample_age_seconds",
            "node": node,
            "instance": instance,
            "job": "gpufleet-agent",
        },
        "values": [[t, repr(v)] for t, v in points],
    }


def test_the_sample_time_is_the_agents_not_the_scrapes() -> None:
    # Scrapes every 5 s of an agent sampling every second land 0.25-0.9 s after its newest sample.
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [990.0, 995.0]) + [age_series("dgx-01", [(990.0, 0.25), (995.0, 0.9)])]
    src, _ = make_source(prom)

    result = run(src.pull_once())

    assert [s.time for s in result.samples] == [989.75, 994.1]
    assert not src.errors


def activity_series(node: str, gpu: int, reading: str, points: list[tuple[float, float, float]]) -> list[dict]:
    """The agent's activity counter pair: (scrape time, seconds active, seconds sampled)."""
    return [
        series("gpufleet_gpu_active_seconds_total", node, gpu, [(t, a) for t, a, _ in points], reading=reading),
        series("gpufleet_gpu_active_sampled_seconds_total", node, gpu, [(t, s) for t, _, s in points], reading=reading),
    ]


def test_activity_ratios_are_the_counters_mean_since_the_previous_scrape_not_the_gauge() -> None:
    prom = FakePrometheus()
    times = [990.0, 995.0, 1000.0, 1005.0]
    prom.stored = gpu_series("dgx-01", 0, times, util=0.9) + [  # gauges: sm_active 0.8, utilization 0.9
        # 5 s at 0.5, then the agent restarted (counters back to 0), then 5 s at 0.6
        *activity_series(
            "dgx-01", 0, "sm_active", [(990.0, 10.0, 20.0), (995.0, 12.5, 25.0), (1000.0, 0.0, 0.0), (1005.0, 3.0, 5.0)]
        ),
        *activity_series("dgx-01", 0, "utilization", [(995.0, 20.0, 25.0), (1000.0, 24.5, 30.0), (1005.0, 29.5, 35.0)]),
        *activity_series("dgx-01", 0, "occupancy", [(990.0, 0.0, 0.0), (995.0, 1.0, 5.0)]),  # not one we use
    ]
    src, now = make_source(prom)
    now[0] = 1006.0

    samples = run(src.pull_once()).samples

    sm = [s.value(0, "sm_active_ratio") for s in samples]
    util = [s.value(0, "utilization_ratio") for s in samples]
    assert sm == pytest.approx([0.8, 0.5, 0.8, 0.6])  # first scrape and after the reset: the gauge
    assert util == pytest.approx([0.9, 0.9, 0.9, 1.0])  # counters from the second scrape on
    assert not src.errors


def test_a_sample_scraped_again_is_not_delivered_again_and_the_agent_turns_stale() -> None:
    # NVML hangs in the agent: it keeps answering scrapes with its last sample, older at every scrape.
    prom = FakePrometheus()
    prom.up = {"10.0.0.1:9471": "1"}
    prom.stored = gpu_series("dgx-01", 0, [995.0]) + [age_series("dgx-01", [(995.0, 0.5)])]
    src, now = make_source(prom, stale_after_seconds=30.0)
    first = run(src.pull_once())
    delivered = []
    for k in range(1, 8):
        now[0] = 1000.0 + 5 * k
        scrapes = [995.0 + 5 * i for i in range(k + 1)]
        prom.stored = gpu_series("dgx-01", 0, scrapes) + [age_series("dgx-01", [(t, t - 994.5) for t in scrapes])]
        delivered += run(src.pull_once()).samples

    assert [s.time for s in first.samples] == [994.5]
    assert delivered == []  # the engine sees the node go silent, and alerts on it
    assert src.health()[0].up and src.health()[0].stale


def test_a_sample_scraped_again_after_a_slower_answer_is_still_the_same_sample() -> None:
    # The age is read as the agent answers, the scrape's time is when Prometheus asked: the second scrape
    # of one sample answered 40 ms slower puts it 40 ms later. A new sample is a sampling period later.
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [990.0, 995.0, 1000.0]) + [
        age_series("dgx-01", [(990.0, 0.5), (995.0, 5.46), (1000.0, 0.3)])
    ]
    src, now = make_source(prom)
    now[0] = 1001.0

    assert [s.time for s in run(src.pull_once()).samples] == [989.5, 999.7]


@pytest.mark.parametrize(
    "answer, reason",
    [
        (httpx.ConnectError("refused"), "connect"),
        (httpx.ReadTimeout("slow"), "timeout"),
        (httpx.Response(503, content=b"<html>unavailable</html>"), "http_status"),
        (httpx.Response(401, content=b"Unauthorized\n"), "http_status"),
        (httpx.Response(200, content=b"<html>a login page</html>"), "malformed_json"),
        # A broken proxy's bytes inside a string: the typed decoder raises UnicodeDecodeError, not DecodeError.
        (
            httpx.Response(
                200,
                content=b'{"status":"success","data":{"resultType":"matrix","result":'
                b'[{"metric":{"node":"dgx-\xb8"},"values":[]}]}}',
            ),
            "malformed_json",
        ),
        (
            httpx.Response(
                400, content=orjson.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"})
            ),
            "query_failed",
        ),
        (httpx.Response(200, content=orjson.dumps({"status": "success", "data": {"result": "nope"}})), "schema"),
    ],
)
def test_a_failing_prometheus_is_counted_and_marks_agents_down_without_raising(answer, reason) -> None:
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [998.0])
    src, now = make_source(prom)
    run(src.pull_once())
    assert [h.up for h in src.health()] == [True]

    prom.override = answer
    now[0] = 1005.0
    result = run(src.pull_once())

    assert result.samples == [] and result.failed_targets == 1
    assert src.errors[("http://prometheus:9090", reason)] == 1
    (health,) = src.health()
    assert not health.up and health.consecutive_failures == 1 and health.last_error.startswith("prometheus: ")
    # Once Prometheus answers again, the scrapes it stored meanwhile arrive: nothing is lost.
    prom.override = None
    prom.stored = gpu_series("dgx-01", 0, [998.0, 1000.0, 1005.0, 1010.0])
    now[0] = 1010.0
    assert [s.time for s in run(src.pull_once()).samples] == [1000.0, 1005.0, 1010.0]
    assert src.health()[0].up


def test_an_answer_that_trickles_is_cut_at_the_timeout() -> None:
    stalled = asyncio.Event()  # never set: the body's second chunk never comes

    async def trickle():
        yield b'{"status": "success", '
        await stalled.wait()

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle())

    src = PrometheusSource(
        "http://prometheus:9090", transport=httpx.MockTransport(handler), timeout_seconds=0.05, parse=parse_snapshot
    )
    result = run(asyncio.wait_for(src.pull_once(), timeout=30))
    assert result.samples == [] and src.errors == {("http://prometheus:9090", "timeout"): 1}


def test_an_oversized_answer_is_refused() -> None:
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [998.0])
    src, _ = make_source(prom, max_answer_bytes=1000)

    result = run(src.pull_once())

    assert result.samples == [] and src.errors[("http://prometheus:9090", "oversized")] == 1


def test_malformed_series_and_points_are_counted_and_the_rest_delivered() -> None:
    prom = FakePrometheus()
    good = gpu_series("dgx-01", 0, [998.0])
    no_node = series("gpufleet_gpu_utilization_ratio", "", 1, [(998.0, 0.5)])
    bad_point = series("gpufleet_gpu_power_watts", "dgx-01", 2, [(998.0, 1.0)])
    bad_point["values"] = [["x", "y"], [998.0]]
    out_of_range = gpu_series("dgx-03", 0, [998.0], util=7.0, instance="10.0.0.3:9471")
    prom.stored = good + [no_node, bad_point, "not a series"] + out_of_range
    src, _ = make_source(prom)

    result = run(src.pull_once())

    assert [s.node for s in result.samples] == ["dgx-01"]
    assert result.samples[0].indices == (0,)
    assert src.errors[("http://prometheus:9090", "schema")] == 5  # no labels, 2 bad points, non-dict, dgx-03
    assert result.rejected_snapshots == 1  # dgx-03: utilization 7.0 breaks the contract


def test_health_names_agents_prometheus_fails_to_scrape() -> None:
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [998.0], instance="10.0.0.1:9471")
    prom.up = {"10.0.0.1:9471": "1", "10.0.0.9:9471": "0"}
    src, _ = make_source(prom)

    run(src.pull_once())

    by_target = {h.target: h for h in src.health()}
    assert by_target["10.0.0.1:9471"].up and by_target["10.0.0.1:9471"].node == "dgx-01"
    down = by_target["10.0.0.9:9471"]
    assert not down.up and down.node is None and "up == 0" in down.last_error
    up_queries = [q for q, _ in prom.queries if q.startswith("up")]
    assert up_queries == ['up{job=~"gpufleet\\\\-agent"}']


def test_an_agent_that_stops_being_scraped_turns_stale() -> None:
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [998.0])
    prom.up = {"10.0.0.1:9471": "1"}
    src, now = make_source(prom, stale_after_seconds=30.0)
    run(src.pull_once())
    now[0] = 1040.0  # Prometheus still says up, but no new scrape of it arrived for 42 s

    run(src.pull_once())

    assert src.health()[0].stale


def test_an_agent_prometheus_no_longer_lists_is_forgotten_after_ten_minutes() -> None:
    # A Kubernetes agent pod restarted elsewhere: its old address leaves discovery, the new one takes over.
    prom = FakePrometheus()
    prom.stored = gpu_series("dgx-01", 0, [998.0], instance="10.0.0.1:9471")
    prom.up = {"10.0.0.1:9471": "1"}
    src, now = make_source(prom)
    run(src.pull_once())
    prom.up = {"10.0.0.7:9471": "1"}
    for t in (1300.0, 1899.0):  # unlisted from 1300 s on
        now[0] = t
        run(src.pull_once())
        assert [h.target for h in src.health()] == ["10.0.0.1:9471", "10.0.0.7:9471"]
    prom.override = httpx.Response(503)  # a failed `up` says nothing about who left
    now[0] = 1900.0
    run(src.pull_once())
    assert len(src.health()) == 2
    prom.override = None
    now[0] = 1901.0
    run(src.pull_once())
    assert [h.target for h in src.health()] == ["10.0.0.7:9471"]


def test_settings_choose_prometheus_and_refuse_it_together_with_agent_targets(tmp_path) -> None:
    settings = load_settings(
        ["--ingest.prometheus-url", "http://prom:9090/", "--storage.path", str(tmp_path / "a.db")], env={}
    )
    source = build_source(settings)
    assert isinstance(source, PrometheusSource) and source.url == "http://prom:9090"
    run(source.aclose())
    with pytest.raises(ConfigError, match="drop targets"):
        load_settings(["--ingest.prometheus-url", "http://prom:9090", "--targets", "a:9471"], env={})
    with pytest.raises(ConfigError, match="ingest.prometheus-url"):
        load_settings(["--ingest.prometheus-url", "prom:9090"], env={})
